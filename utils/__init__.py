"""What every part of the course shares: the models, sampling, the checker, logging and plotting.

Importing `utils` first also sets how torch's CPU threads wait for work (utils/cpu_policy.py), which OpenMP reads
only once, when torch is first imported.
"""

from utils.cpu_policy import apply_wait_policy

apply_wait_policy()
