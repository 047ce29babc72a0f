"""The name notebooks saved before the checker became one package imported `check` from: kept for them."""

from utils.checker.notebook import check  # noqa: F401
