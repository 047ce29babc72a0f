# The image `python -m utils.grade` runs in for a class you do not trust (docs/teachers.md, "Grading a class"): Python
# and the course's locked requirements, nothing else. The course itself and the submissions are mounted at run time, so
# the image is built once per lock, not per course edit:
#
#     docker build -t rlhf-course-grader .
#
# Installs as .ci/run does, torch first, then the lock; torch from PyTorch's CPU index, since PyPI's torch for Linux
# pulls several GB of CUDA packages that grading does not use. (Not built in this repository's CI: no Docker there.)
FROM python:3.11-slim

COPY requirements.txt constraints.txt /tmp/lock/
RUN python -m pip install --no-cache-dir --upgrade pip \
    && python -m pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && python -m pip install --no-cache-dir -r /tmp/lock/requirements.txt -c /tmp/lock/constraints.txt \
    && rm -rf /tmp/lock

# Grade as a user with no rights outside the mounted folders; offline, as the grader's workers are anyway.
RUN useradd --create-home grader
USER grader
ENV HF_HUB_OFFLINE=1 WANDB_MODE=disabled MPLBACKEND=Agg
