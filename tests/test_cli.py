"""The ``kvgates`` command line on a tiny local checkpoint."""

import pytest
from helpers import save_tiny_checkpoint

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
    import torch

    from kvgates import BudgetCache, load_model

    model, tok = load_model(checkpoint, device_map={"": "cpu"})
    assert all(p.device.type == "cpu" for p in model.parameters()) and not model.training
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    out = model.generate(ids, past_key_values=BudgetCache(model.config, "h2o", budget=4), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3 and torch.isfinite(model(ids).logits).all()
