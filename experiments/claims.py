"""Published claims as data, and the verdict of a measurement against one.

A claim names its value (a point or a range), where it comes from, the relative tolerance
we judge it with, and how it maps onto what a run measures. Experiments compare their
measurements with it through :func:`compare`, which gives one row of a comparison table.

A derived claim (``Claim.derived``) is judged on arithmetic with no run behind it (our
estimator, a fixed synthetic example): its verdicts are "formula agrees" and "formula
disagrees", never "holds", and its rows go in a derived table (:func:`derived_table`),
which holds no measured row; a measured table holds no derived one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
NOT_COMPARABLE = "not comparable here"
FORMULA_AGREES = "formula agrees"
FORMULA_DISAGREES = "formula disagrees"
MEASURED_VERDICTS = (HOLDS, DOES_NOT_HOLD)
DERIVED_VERDICTS = (FORMULA_AGREES, FORMULA_DISAGREES)

# The columns of every comparison table (ratio: ours / paper; see ratio()).
COMPARISON_COLUMNS = ("claim", "setting", "ours", "paper", "ratio", "verdict")
# A measurement against a formula of ours rather than a published figure.
FORMULA_COLUMNS = ("claim", "setting", "ours", "our formula", "ratio", "verdict")
# A derived table: our arithmetic against the published figure, nothing measured.
DERIVED_COLUMNS = ("claim", "setting", "our arithmetic", "paper", "ratio", "verdict")
DERIVED_NOTE = (
    "Derived, not measured: no run is behind these rows; ours is arithmetic. formula "
    "agrees / formula disagrees: that arithmetic is within / outside the claim's tolerance."
)


@dataclass(frozen=True)
class Claim:
    key: str
    statement: str  # what the source says, in its own terms
    value: str  # the published figure, as the source states it (e.g. "4Φ + 12Φ/N")
    source: str  # citation; the figures are in docs/references.md
    tolerance: float  # relative: |ours / paper - 1| (or the distance to a range) allowed
    maps_to: str  # what we measure to test it, and how it converts
    derived: bool = False  # judged on arithmetic, no run: formula agrees / disagrees


@dataclass
class Table:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple] = field(default_factory=list)
    note: str = ""
    derived: bool = False  # every row arithmetic, no run (derived_table)

    def __post_init__(self) -> None:
        if "verdict" not in self.columns:
            return
        foreign = MEASURED_VERDICTS if self.derived else DERIVED_VERDICTS
        mixed = [row[0] for row in self.rows if row[-1] in foreign]
        if mixed:
            kind = "measured" if self.derived else "derived"
            raise ValueError(f"table {self.title!r} holds {kind} rows: {', '.join(mixed)}")

    @property
    def key(self) -> str:
        return "".join(c if c.isascii() and c.isalnum() else "_" for c in self.title.lower()).strip(
            "_"
        )


def verdict(ours: float, paper: float | tuple[float, float], tolerance: float) -> str:
    """holds when ``ours`` is within ``tolerance`` (relative) of the point, or of the range."""
    lo, hi = paper if isinstance(paper, tuple) else (paper, paper)
    # Bounds are inclusive, also of rounding: 3e-3 / 3e-4 is 10.000000000000002.
    lo_ok = ours >= lo - abs(lo) * tolerance or math.isclose(ours, lo)
    # An open range (hi = inf) has no upper bound; inf * 0 would be nan.
    hi_ok = math.isinf(hi) or ours <= hi + abs(hi) * tolerance or math.isclose(ours, hi)
    return HOLDS if lo_ok and hi_ok else DOES_NOT_HOLD


def ratio(ours: float, paper: float | tuple[float, float]) -> float | None:
    """ours / paper: a range's midpoint, or its lower bound when it is open above."""
    if isinstance(paper, tuple) and math.isinf(paper[1]):
        paper = paper[0]
    mid = sum(paper) / 2 if isinstance(paper, tuple) else paper
    return None if mid == 0 else ours / mid


def fmt(value, unit: str = "", digits: int = 3) -> str:
    """A number for a table: thousands separators for integers, ``digits`` significant
    digits else."""
    if value is None:
        return "-"
    if isinstance(value, tuple):
        if value[0] == value[1]:
            return fmt(value[0], unit, digits)
        if math.isinf(value[1]):
            return f">= {fmt(value[0], '', digits)}{unit}"
        return f"{fmt(value[0], '', digits)}-{fmt(value[1], '', digits)}{unit}"
    if isinstance(value, str):
        return value
    if float(value).is_integer() and abs(value) >= 1000:
        return f"{int(value):,}{unit}"
    return f"{value:.{digits}g}{unit}"


def compare(
    claim: Claim,
    setting: str,
    ours: float | None,
    paper: float | tuple[float, float],
    unit: str = "",
    not_comparable: str | None = None,
) -> tuple:
    """One row of a comparison table. ``ours`` None (a failed job) or a ``not_comparable``
    reason gives the verdict "not comparable here" with the reason. A derived claim's
    verdict is "formula agrees" or "formula disagrees". Tight tolerances show more digits,
    so a deviation inside or outside them is visible."""
    # A point with a tight tolerance needs the digits that show the deviation.
    tight = 5 if claim.tolerance >= 1e-3 or isinstance(paper, tuple) else 7
    digits = 3 if claim.tolerance >= 0.1 else tight
    if not_comparable is None and ours is None:
        not_comparable = "no measurement (the job failed)"
    if not_comparable is not None:
        shown = "-" if ours is None else fmt(ours, unit)
        return (
            claim.key,
            setting,
            shown,
            fmt(paper, unit),
            "-",
            f"{NOT_COMPARABLE}: {not_comparable}",
        )
    r = ratio(ours, paper)
    judged = verdict(ours, paper, claim.tolerance)
    if claim.derived:
        judged = FORMULA_AGREES if judged == HOLDS else FORMULA_DISAGREES
    return (
        claim.key,
        setting,
        fmt(ours, unit, digits),
        fmt(paper, unit, digits),
        "-" if r is None else f"{r:.{digits - 1}f}",
        judged,
    )


def derived_table(title: str, rows: list[tuple], note: str = "") -> Table:
    """The table of derived claims' rows, titled and noted so it reads as arithmetic."""
    return Table(
        f"{title} (derived: arithmetic, no run)",
        DERIVED_COLUMNS,
        rows,
        note=f"{DERIVED_NOTE} {note}".strip(),
        derived=True,
    )


def claims_table(claims: dict[str, Claim]) -> Table:
    return Table(
        "Claims tested",
        ("claim", "statement", "published", "source", "tolerance", "what we measure"),
        [
            (
                c.key,
                c.statement,
                c.value,
                c.source,
                f"{c.tolerance:.0%}",
                f"derived, no run: {c.maps_to}" if c.derived else c.maps_to,
            )
            for c in claims.values()
        ],
    )
