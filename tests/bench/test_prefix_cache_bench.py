"""`python -m blockdraft.bench.prefix_cache` on the tiny target with a DFlash drafter: the cache is
hit on the shared system prompt and every answer equals the one without the cache."""

import json

from blockdraft.bench import prefix_cache
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


def test_shared_system_prompt_is_served_from_the_cache_with_the_same_answers(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    args = ["--model", str(model), "--draft", str(drafter), "--system-tokens", "64", "--max-tokens", "4",
            "--num-questions", "2", "--json", str(tmp_path / "r.json")]
    assert prefix_cache.main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["identical"] and len(doc["requests"][prefix_cache.ON]) == 2
    # every timed question reuses the system prompt's full pages (the warm-up filled them)
    assert doc["prefix_cache_hits"] >= 2 * 64 // 16 * 16
    assert "prefix caching on" in capsys.readouterr().out


def test_question_count_out_of_range_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        prefix_cache.main(["--num-questions", "0"])
    assert "--num-questions must be in [1, 6], got 0" in capsys.readouterr().err
