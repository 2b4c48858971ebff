"""teamrl.evaluation."""

from teamrl.envs.code_schemes import SCHEMES, SchemeResult, classify_scheme, scheme_distribution
from teamrl.evaluation.metrics import (
                                       accuracy_at_k,
                                       normalised_return,
                                       pass_at_k,
                                       pass_at_k_many,
                                       summarise_levels,
                                       tokens_per_second,
)

__all__ = ["SCHEMES", "SchemeResult", "accuracy_at_k", "classify_scheme", "normalised_return", "pass_at_k",
           "pass_at_k_many", "scheme_distribution", "summarise_levels", "tokens_per_second"]
