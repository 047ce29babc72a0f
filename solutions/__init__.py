"""The reference solutions, one module per part (a package for a part with several topics: part6_lab/).

Their shape annotations (jaxtyping, e.g. `Float[Tensor, "batch gen"]`) are contracts checked at every call, in
scripts and notebooks as in the tests: a tensor of the wrong shape is refused at the call with the name of the
argument and the dimensions expected, and tensors whose dimensions share a name must agree. (The checker holds
whatever else it tests, a learner's function or a wrong version, to the same annotations: utils/checker/shapes.py.) Setting
RLHF_SHAPE_CHECKS=0 turns the checks off (bench/shape_checks.py measures what they cost).
"""

import os

import utils  # noqa: F401  (first: the course's CPU wait policy must be set before torch loads)

if os.environ.get("RLHF_SHAPE_CHECKS", "1") != "0":
    from jaxtyping import install_import_hook

    install_import_hook("solutions", "beartype.beartype")
