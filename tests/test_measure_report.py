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
    assert _layout(plain).endswith("offload none")
    assert _layout(offloading).endswith("offload go [0, 1], oo [0, 1]")


def test_one_layout_text_for_every_report():
    """docs/design.md, Glossary (layout): the degrees first, then per stage in run-length form."""
    from mist_ds.specs.strategy import layout_text

    specs = compose(["model=tiny", "cluster=cpu", "strategy.pp=2", "strategy.ckpt_layers=[0,1]",
                     "strategy.offload.activations=[0.5,0]", "train.global_batch_size=8", "strategy.runtime=mist"])
    assert layout_text(specs.strategy) == ("tp 1 x pp 2 x dp 1, b 1 x G 8; layers [4 (x2)]; recompute [0, 1]; "
                                           "ZeRO [0 (x2)]; offload ao [0.5, 0]")
