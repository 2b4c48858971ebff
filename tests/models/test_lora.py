"""The LoRA kernels of a team on one base (teamrl.models.lora) compute what PEFT's own routing computes."""

from __future__ import annotations

import pytest
import torch

import teamrl.models.lora as lora_module
from teamrl.models.lora import RowAdapters, active_adapter_fused


@pytest.mark.parametrize("layout", ["uneven", "blocks"])
def test_stacked_adapters_compute_what_peft_routing_computes(lora_team, monkeypatch, layout):

    team = lora_team()
    model = team[0].model.eval()
    first, second = team[1].adapter, team[0].adapter
    # Uneven runs of rows take the masked sum; a team's layout (consecutive equal blocks) the batched one.
    names = [first, second, second, first] if layout == "uneven" else [first, first, second, second]
    own_row = names.index(team[0].adapter)
    grouped_calls = []
    grouped = lora_module._add_low_rank_grouped
    monkeypatch.setattr(lora_module, "_add_low_rank_grouped",
                        lambda *args: grouped_calls.append(1) or grouped(*args))
    ids = torch.randint(3, 15, (4, 6))
    rows = RowAdapters.build(model, names)
    assert len(rows.layers) > 0
    with torch.no_grad(), rows.route(names) as routing:
        assert routing == {}  # the replaced forwards route, not PEFT
        stacked = model(input_ids=ids).logits
    assert bool(grouped_calls) == (layout == "blocks")
    with torch.no_grad():
        peft_routed = model(input_ids=ids, adapter_names=names).logits
        team[0].activate()
        own = model(input_ids=ids[own_row:own_row + 1]).logits
    torch.testing.assert_close(stacked, peft_routed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stacked[own_row:own_row + 1], own, atol=1e-5, rtol=1e-5)
    assert not any("forward" in vars(module) for module, _, _ in rows.layers)  # PEFT's forward is back
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids[:1]).logits, stacked[:1])  # adapters are back on


def test_adapter_variants_keep_peft_routing(lora_team):

    team = lora_team()
    model = team[0].model
    names = [team[0].adapter, team[1].adapter]
    layer = next(m for m, _, _ in RowAdapters.build(model, names).layers)
    layer.lora_variant[team[0].adapter] = object()  # e.g. DoRA: not a plain A/B pair
    rows = RowAdapters.build(model, names)
    with rows.route(names) as routing:
        assert routing == {"adapter_names": names} and not rows.layers


def test_merged_adapters_keep_peft_routing(lora_team):

    team = lora_team()
    model = team[0].model
    names = [team[0].adapter, team[1].adapter]
    team[0].activate()
    model.merge_adapter()  # the base weights now hold the adapter: adding it again would count it twice
    rows = RowAdapters.build(model, names)
    with rows.route(names) as routing:
        assert routing == {"adapter_names": names} and not rows.layers
    with active_adapter_fused(model):
        assert not any("forward" in vars(module) for module in model.modules())
