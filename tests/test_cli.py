"""The ``kvgates`` command line on a tiny local checkpoint."""

import pytest
import torch
from helpers import policy_on, save_tiny_checkpoint

from kvgates import BudgetCache, load_model
from kvgates.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_generate_prints_text_and_memory(checkpoint, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog " * 4)
    code = main(
        ["generate", "--model", checkpoint, "--policy", "snapkv", "--budget", "24", "--window", "4", "--kernel", "3",
         "--prompt-file", str(prompt), "--max-new-tokens", "5"]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "policy=snapkv" in err and "KV held" in err and "vs full cache" in err


def test_generate_sampled_with_chunks(checkpoint, capsys):
    code = main(["generate", "--model", checkpoint, "--policy", "h2o", "--budget", "8", "--prompt", "hello there " * 5,
                 "--sample", "--prefill-chunk", "16", "--max-new-tokens", "4"])
    assert code == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--policy", "snapkv", "--budget", "8", "--window", "16", "--prompt", "x"], "observation window"),
        (["--policy", "h2o", "--budget", "0", "--prompt", "x"], "at least 1"),
        (["--policy", "h2o", "--budget", "8", "--prompt-file", "/nonexistent"], "does not exist"),
    ],
)
def test_bad_input_is_one_clear_error(checkpoint, capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["generate", "--model", checkpoint, *argv])
    assert message in capsys.readouterr().err


def test_unknown_policy(capsys):
    assert main(["generate", "--policy", "nope", "--prompt", "x"]) == 2
    assert "available policies" in capsys.readouterr().err


def test_policies_lists_registry(capsys):
    assert main(["policies"]) == 0
    assert "snapkv" in capsys.readouterr().out


def test_load_model_with_an_accelerate_device_map(checkpoint):
    model, tok = load_model(checkpoint, device_map={"": "cpu"})
    assert all(p.device.type == "cpu" for p in model.parameters()) and not model.training
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    out = model.generate(ids, past_key_values=BudgetCache(model.config, "h2o", budget=4), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3 and torch.isfinite(model(ids).logits).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to spread layers over two devices")
@pytest.mark.parametrize("name", ["d2o", "dynamickv", "trimkv-global"])
def test_cross_layer_policies_with_layers_on_two_devices(checkpoint, name):
    """device_map may put layers on different devices; policies that decide across layers must still work."""
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = []
    for device_map in ({"": "cpu"}, {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": 0,
                                     "model.layers.2": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}):
        model, _ = load_model(checkpoint, device_map=device_map)
        torch.manual_seed(0)
        with policy_on(model, name, 12) as policy, torch.no_grad():
            cache = BudgetCache(model.config, policy)
            out = [model(ids[:, :30], past_key_values=cache).logits[:, -1]]
            out += [model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in range(30, 40)]
        logits.append(torch.stack(out).cpu())
        assert int(cache.held_tokens().max()) <= 12 + 10
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
