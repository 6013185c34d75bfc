"""Hypothesis' profiles for the suite, registered and loaded on import
(tests/conftest.py imports this module before any test module), and the
example counts the property tests scale with them."""

from __future__ import annotations

import os

from hypothesis import settings

# The property tests of test_parity_properties.py take most of a full run: on
# two CPU cores each example compiles kernels (g++) for its epsilon, dtype and
# rank. Their example counts are written for
# Hypothesis' default profile (max_examples 100) and scale with the profile
# loaded (scaled_examples), never below MINIMUM_EXAMPLES:
#
#   profile    selected by                      compiled vs composed / replays
#                                               over new shapes / interleaved eps
#   default    neither variable set             60 / 25 / 20 examples
#   ci         CI set (HYPOTHESIS_PROFILE wins)  15 /  6 /  5 examples
#   thorough   HYPOTHESIS_PROFILE=thorough      240 / 100 / 80 examples
#
# The ci profile keeps Hypothesis' own CI settings (derandomized, so a
# failure reproduces with HYPOTHESIS_PROFILE=ci; no example database; no
# deadline): its 15 examples still span ranks 1-4, the three dtypes, every
# weighting and special values; 6 replays chain 2-5 shapes each; 5 epsilon
# pairs alternate four calls each. The thorough profile is for exploring
# before a release.
MINIMUM_EXAMPLES = 5
settings.register_profile(
    "ci", parent=settings.get_profile("ci"), max_examples=25, deadline=None
)
settings.register_profile("thorough", max_examples=400, deadline=None)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif os.environ.get("CI"):
    settings.load_profile("ci")


def scaled_examples(default_profile_examples: int) -> int:
    """A test's ``max_examples`` under the loaded profile: the count it runs
    under the default profile (100 examples), scaled by the loaded
    profile's ``max_examples`` / 100."""
    scaled = round(default_profile_examples * settings.default.max_examples / 100)
    return max(MINIMUM_EXAMPLES, scaled)
