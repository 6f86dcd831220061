"""One measured (or skipped) row of `llmopt bench kernels`: a back end on one problem."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class KernelRun:
    """A back end's time on one problem, with what it streamed and how close it came to the reference.

    `bytes_read`: the operand bytes the figure of merit counts (int4 matmul: the weight as
    stored; decode attention: the K/V rows the sequences attend to). `speedup`: the dense /
    PyTorch baseline's time over this one (the baseline itself has 1.0; None where the
    problem has no baseline). `skipped`: why the back end did not run (then no figures).
    """

    kernel: str  # "int4_matmul" | "paged_decode"
    problem: str  # "qkv 4096->6144 M=1", "batch 8 x 4096 tokens"
    backend: str
    reference: str = ""  # what max_abs_diff is measured against
    time_s: float | None = None
    bytes_read: int | None = None
    speedup: float | None = None
    baseline: bool = False  # the dense / PyTorch path the other back ends of the problem are compared with
    max_abs_diff: float | None = None
    rel_diff: float | None = None  # max |diff| / max |reference|
    copy_bandwidth_gb_s: float | None = None  # the run's measured copy bandwidth, for the ratio
    skipped: str | None = None

    @property
    def gb_s(self) -> float | None:
        return None if self.time_s is None or self.bytes_read is None else self.bytes_read / self.time_s / 1e9

    def as_dict(self) -> dict[str, Any]:
        """The results.json run: the fields, a unique label (compare matches on it) and derived figures."""
        out = asdict(self)
        out["label"] = f"{self.kernel} {self.problem} {self.backend}"
        out["time_us"] = None if self.time_s is None else self.time_s * 1e6
        out["gb_s"] = self.gb_s
        out["fraction_of_copy_bw"] = (None if self.gb_s is None or not self.copy_bandwidth_gb_s
                                      else self.gb_s / self.copy_bandwidth_gb_s)
        return out


def max_diff(got, ref) -> tuple[float, float]:
    """(max |got - ref|, that over max |ref|), both in float64."""
    diff = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff, diff / scale if scale else diff
