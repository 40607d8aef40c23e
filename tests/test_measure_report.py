"""`mist-ds measure`'s text: the one line naming what was measured tells plans apart (no ranks run here)."""
from __future__ import annotations

from mist_ds.config import compose
from mist_ds.report.measure import _layout


def test_the_summary_line_names_the_offload():
    """Issue 25, defect 9: an offloading plan and one that does not offload printed the same line."""
    tiny = ["model=tiny", "cluster=cpu", "strategy.pp=2", "strategy.zero_stage=1", "train.global_batch_size=8"]
    plain = compose(tiny).strategy.to_dict()
    offloading = compose([*tiny, "strategy.offload.optimizer=[0,1]",
                          "strategy.offload.grads=[0,1]"]).strategy.to_dict()
    assert _layout(plain).endswith("offload w/g/o/a 0/0/0/0")
    assert _layout(offloading).endswith("offload w/g/o/a 0/0,1/0,1/0")
