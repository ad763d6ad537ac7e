"""Medusa heads: initialisation, the three file formats, and strict loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from medusa_export.errors import HeadsFormatError
from medusa_export.loading.heads_formats import load_heads, read_head_tensors
from medusa_export.model.heads import HeadsConfig, MedusaHeads, save_heads

HIDDEN, VOCAB = 16, 37


def _lm_head(vocab=VOCAB, hidden=HIDDEN, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(head.weight)
    return head


def random_heads(num_heads=3, num_layers=2, own_projection=True, hidden=HIDDEN, vocab=VOCAB, seed=1):
    heads = MedusaHeads(HeadsConfig(num_heads, num_layers, hidden, vocab, own_projection), _lm_head(vocab, hidden))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    return heads


def _write(tensors: dict, path, config: dict | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    else:
        torch.save(tensors, str(path))
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps(config))
    return path


def _assert_same_heads(a: MedusaHeads, b: MedusaHeads):
    assert a.config == b.config
    sa, sb = a.head_state_dict(), b.head_state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_initial_heads_reproduce_the_base_prediction():
    lm_head = _lm_head()
    for own in (True, False):
        heads = MedusaHeads(HeadsConfig(4, 2, HIDDEN, VOCAB, own), lm_head)
        x = torch.randn(3, HIDDEN)
        out = heads(x)
        assert out.shape == (4, 3, VOCAB)
        for k in range(4):
            torch.testing.assert_close(out[k], lm_head(x))


def test_heads_modules_are_distinct():
    heads = random_heads(num_heads=3, num_layers=2)
    weights = [heads.heads[h][l].linear.weight for h in range(3) for l in range(2)]
    assert len({w.data_ptr() for w in weights}) == 6
    assert not torch.equal(weights[0], weights[1])
    assert len(heads.head_state_dict()) == 3 * (2 * 2 + 1)  # 2 blocks of weight+bias, 1 projection per head


def test_shared_projection_uses_the_lm_head():
    heads = random_heads(own_projection=False)
    lm_head = heads._shared[0]
    x = torch.randn(HIDDEN)
    torch.testing.assert_close(heads(x)[1], lm_head(heads.heads[1](x)))
    assert not any(k.endswith(f".{heads.config.num_layers}.weight") for k in heads.head_state_dict())


@pytest.mark.parametrize(
    "name, own, with_config",
    [
        ("medusa_lm_head.pt", True, True),
        ("medusa_lm_head.pt", False, False),  # legacy heads: no projection, no config (counts inferred)
        ("medusa_lm_head.safetensors", True, False),
        ("medusa_lm_head.safetensors", False, True),
    ],
)
def test_fasterdecoding_formats_round_trip(tmp_path, name, own, with_config):
    heads = random_heads(num_heads=3, num_layers=2, own_projection=own)
    config = {"medusa_num_heads": 3, "medusa_num_layers": 2} if with_config else None
    path = _write(heads.head_state_dict(), tmp_path / "ckpt" / name, config)
    _assert_same_heads(heads, load_heads(path.parent, heads._shared[0]))  # the directory
    _assert_same_heads(heads, load_heads(path, heads._shared[0]))  # the file itself


@pytest.mark.parametrize("own", [True, False])
def test_our_format_round_trip(tmp_path, own):
    heads = random_heads(num_heads=4, num_layers=1, own_projection=own)
    save_heads(heads, tmp_path / "h", extra={"recipe": "test"})
    meta = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert meta["format"] == "medusa-export-heads" and meta["num_heads"] == 4 and meta["recipe"] == "test"
    _assert_same_heads(heads, load_heads(tmp_path / "h", heads._shared[0]))


def test_heads_are_cast_to_the_backbone_dtype(tmp_path):
    heads = random_heads()
    path = _write({k: v.double() for k, v in heads.head_state_dict().items()}, tmp_path / "medusa_lm_head.pt")
    loaded = load_heads(path, heads._shared[0])
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


# --- bad heads files: each a HeadsFormatError naming the key --------------------------------------


def _bad(tensors: dict, change) -> dict:
    tensors = dict(tensors)
    change(tensors)
    return tensors


GOOD = random_heads(num_heads=3, num_layers=2, own_projection=True).head_state_dict()
GOOD_SHARED = random_heads(num_heads=3, num_layers=2, own_projection=False).head_state_dict()


@pytest.mark.parametrize(
    "tensors, message",
    [
        (_bad(GOOD, lambda t: t.update({"0.0.linear.scale": torch.ones(HIDDEN)})),
         r"unexpected key '0\.0\.linear\.scale'"),
        (_bad(GOOD, lambda t: t.update({"medusa_head.0.0.linear.weight": t["0.0.linear.weight"]})),
         r"unexpected key 'medusa_head\.0\.0\.linear\.weight'"),
        (_bad(GOOD, lambda t: t.pop("1.0.linear.bias")), r"missing key '1\.0\.linear\.bias'"),
        (_bad(GOOD, lambda t: t.update({"2.1.linear.weight": torch.ones(HIDDEN, HIDDEN + 1)})),
         r"key '2\.1\.linear\.weight' has shape \(16, 17\), expected \(16, 16\)"),
        (_bad(GOOD, lambda t: t.update({"1.2.weight": torch.ones(VOCAB + 1, HIDDEN)})),
         r"key '1\.2\.weight' has shape \(38, 16\), expected \(37, 16\)"),
        (_bad(GOOD, lambda t: [t.pop(k) for k in list(t) if k.startswith("1.")]),
         r"heads \[0, 2\]; expected 0\.\.2 \(missing key '1\.0\.linear\.weight'\)"),
        (_bad(GOOD, lambda t: t.pop("2.2.weight")),
         r"missing key '2\.2\.weight' \(the heads have 2 block\(s\) and its own projection each\)"),
        (_bad(GOOD, lambda t: t.update({"1.3.linear.weight": torch.ones(HIDDEN, HIDDEN)})),
         r"unexpected key '1\.3\.linear\.weight' in heads file: the heads have 2 block\(s\)"),
        (_bad(GOOD_SHARED, lambda t: t.update({"0.2.weight": torch.ones(VOCAB, HIDDEN)})),
         r"unexpected key '0\.2\.weight' in heads file: the heads have 2 block\(s\) and no own projection"),
        (_bad(GOOD_SHARED, lambda t: t.pop("2.1.linear.weight")), r"missing key '2\.1\.linear\.weight'"),
        ({}, "holds no tensors"),
    ],
    ids=["unexpected-key", "prefixed-key", "missing-bias", "wrong-hidden", "wrong-vocab", "missing-head",
         "missing-projection", "stray-block", "stray-projection", "missing-block-weight", "empty"],
)
def test_bad_heads_file(tmp_path, tensors, message):
    path = _write(tensors, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(HeadsFormatError, match=message):
        load_heads(path, _lm_head())


def test_heads_for_another_backbone(tmp_path):
    """Heads of hidden 24 against a backbone of hidden 16: the first key is named."""
    path = _write(random_heads(hidden=24).head_state_dict(), tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(HeadsFormatError, match=r"key '0\.0\.linear\.weight' has shape \(24, 24\), expected \(16, 16\)"):
        load_heads(path, _lm_head())


@pytest.mark.parametrize(
    "config, message",
    [
        ({"medusa_num_heads": 2, "medusa_num_layers": 2}, "config.json says 2 heads but the weights hold 3"),
        ({"medusa_num_heads": 3, "medusa_num_layers": 1}, "config.json says 1 layers per head but the weights hold 2"),
    ],
)
def test_third_party_config_miscounting_the_weights_warns(tmp_path, config, message):
    """FasterDecoding's medusa-vicuna-7b-v1.3 config.json says 2 heads for its 5: the keys decide."""
    path = _write(GOOD, tmp_path / "medusa_lm_head.pt", config)
    with pytest.warns(UserWarning, match=message):
        heads = load_heads(tmp_path, _lm_head())
    assert (heads.config.num_heads, heads.config.num_layers) == (3, 2)
    assert path.is_file()


def test_our_config_contradicting_the_weights(tmp_path):
    heads = random_heads(num_heads=3, num_layers=2)
    save_heads(heads, tmp_path)
    meta = json.loads((tmp_path / "heads.json").read_text())
    (tmp_path / "heads.json").write_text(json.dumps({**meta, "num_heads": 2}))
    with pytest.raises(HeadsFormatError, match="config says 2 heads but the weights hold 3"):
        load_heads(tmp_path, heads._shared[0])


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: only a full (unsafe) unpickler would do it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_torch_pickle_is_loaded_weights_only(tmp_path):
    marker = tmp_path / "executed"
    path = _write({"0.0.linear.weight": _Payload(marker)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(HeadsFormatError, match="cannot read heads file"):
        read_head_tensors(path)
    assert not marker.exists()


def test_non_tensor_values_are_refused(tmp_path):
    path = _write({"0.0.linear.weight": 3}, tmp_path / "medusa_lm_head.pt")  # an int passes weights_only
    with pytest.raises(HeadsFormatError, match="not a flat dict of tensors"):
        read_head_tensors(path)


def test_missing_heads(tmp_path):
    with pytest.raises(HeadsFormatError, match="does not exist"):
        read_head_tensors(tmp_path / "nope.pt")
    with pytest.raises(HeadsFormatError, match="no heads file in"):
        load_heads(tmp_path, _lm_head())


# --- a heads-only file whose keys carry a full model's prefix (as medusa-1.0 / modelopt shards store them) --------


@pytest.mark.parametrize("prefix", ["medusa_head.", "medusa_heads."])
@pytest.mark.parametrize("name", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_standalone_heads_file_with_a_model_prefix(tmp_path, prefix, name):
    """Heads cut out of a medusa-1.0 (``medusa_head.``) or modelopt (``medusa_heads.``) checkpoint keep their
    prefix: both loaders (the PyTorch one and the build's streamed sources) take them as the shards' heads."""
    from types import SimpleNamespace

    from medusa_export.loading.sources import open_heads

    heads = random_heads(num_heads=3, num_layers=2, own_projection=True)
    state = heads.head_state_dict()
    path = _write({prefix + k: v for k, v in state.items()}, tmp_path / "h" / name)
    _assert_same_heads(heads, load_heads(path, heads._shared[0]))
    _assert_same_heads(heads, load_heads(path.parent, heads._shared[0]))
    src, cfg = open_heads(path.parent, SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB))
    assert cfg == heads.config and sorted(src.keys()) == sorted(state)
    for k, v in state.items():
        assert torch.equal(src.read(k), v), k


def test_standalone_heads_file_mixing_prefixed_and_bare_keys(tmp_path):
    """Half prefixed, half not: two sets of names for one set of heads is refused by both loaders, naming a key."""
    from types import SimpleNamespace

    from medusa_export.loading.sources import open_heads

    state = dict(GOOD)
    state["medusa_head.0.0.linear.weight"] = state.pop("0.0.linear.weight")
    path = _write(state, tmp_path / "medusa_lm_head.safetensors")
    message = r"unexpected key 'medusa_head\.0\.0\.linear\.weight'"
    with pytest.raises(HeadsFormatError, match=message):
        load_heads(path, _lm_head())
    with pytest.raises(HeadsFormatError, match=message):
        open_heads(path, SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB))
