"""Negative controls for hypothesis example counts: a property test's own examples, run on a broken
implementation, must fail within its example count (docs/PERF.md, "In-process CLI, hypothesis, the
quick loop")."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.internal.reflection import function_digest
from hypothesis.strategies import SearchStrategy


def examples_until_failure(test: Callable[..., Any], nodeid: str | None,
                           strategies: dict[str, SearchStrategy], broken: Callable[..., None]) -> int:
    """Draw the examples that the `@given` test `test` runs as the pytest item `nodeid` (its
    derandomized seed, its max_examples; `strategies` are its @given arguments, in their order; None
    for a test that is not parametrized) and call `broken(**drawn)` on each: the test's check on a
    broken implementation. Returns the 1-based index of the first example that fails; raises
    AssertionError when none of them does."""
    inner = test.hypothesis.inner_test
    own = getattr(test, "_hypothesis_internal_use_settings", settings())
    saved = inner.__dict__.get("_hypothesis_internal_add_digest")
    # the hypothesis pytest plugin keys a parametrized test's seed by its node id (and only such a test's)
    if nodeid is not None:
        inner._hypothesis_internal_add_digest = nodeid.encode()
    try:
        digest = int.from_bytes(function_digest(inner), "big")
    finally:
        if saved is None:
            inner.__dict__.pop("_hypothesis_internal_add_digest", None)
        else:
            inner._hypothesis_internal_add_digest = saved
    outcomes: list[bool] = []

    def body(**drawn: Any) -> None:
        try:
            broken(**drawn)
        except AssertionError:
            outcomes.append(False)
            raise
        outcomes.append(True)

    replay = given(**strategies)(body)
    replay = settings(own, phases=[Phase.generate], database=None, report_multiple_bugs=False, deadline=None,
                      suppress_health_check=list(HealthCheck))(replay)
    try:
        seed(digest)(replay)()
    except AssertionError:
        return outcomes.index(False) + 1
    raise AssertionError(f"{nodeid or test.__name__}: no failure within its {own.max_examples} examples")


def ci_examples(count: int) -> settings:
    """`@ci_examples(count)`: `count` examples under the suite's `ci` profile (instead of its 25), for a
    test whose negative control shows the count still catches the broken property; another profile
    (`thorough`, PARITY_HYPOTHESIS_PROFILE) keeps its own count."""
    if os.environ.get("PARITY_HYPOTHESIS_PROFILE", "ci") != "ci":
        return settings()
    return settings(max_examples=count)
