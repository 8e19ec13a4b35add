"""tfm/data/download.py (./launch.sh data) and the data a fresh clone has: no network needed."""

from __future__ import annotations

import gzip
import io
import subprocess
import urllib.error
from pathlib import Path

import pytest

from configs import char_lm, translate
from tfm.data import ASSETS, builders, download

REPO = Path(__file__).resolve().parents[2]


def fake_files() -> dict[str, bytes]:
    return {name: gzip.compress("".join(f"line {i}\n" for i in range(lines)).encode())
            for name, lines in download.MULTI30K_FILES.items()}


def serve(monkeypatch, files: dict[str, bytes], requested: list[str]) -> None:
    def urlopen(url, timeout):
        requested.append(url)
        name = url.rsplit("/", 1)[1]
        if name not in files:
            raise urllib.error.URLError("[Errno -2] Name or service not known")
        return io.BytesIO(files[name])

    monkeypatch.setattr(download.urllib.request, "urlopen", urlopen)


def test_multi30k_downloads_checks_and_keeps_complete_files(tmp_path, monkeypatch):
    files, requested = fake_files(), []
    serve(monkeypatch, files, requested)
    paths = download.fetch_multi30k(tmp_path / "multi30k")
    assert [p.name for p in paths] == list(download.MULTI30K_FILES)
    assert requested == [download.MULTI30K_URL + name for name in download.MULTI30K_FILES]
    assert all(p.read_bytes() == files[p.name] for p in paths)
    assert not list((tmp_path / "multi30k").glob("*.partial"))
    serve(monkeypatch, {}, requested := [])  # offline now: complete files are kept
    assert download.fetch_multi30k(tmp_path / "multi30k") == paths and requested == []


def test_offline_says_in_one_line_where_to_put_the_files(tmp_path, monkeypatch):
    serve(monkeypatch, {}, [])
    with pytest.raises(download.DownloadError) as error:
        download.fetch_multi30k(tmp_path / "m")
    assert str(error.value) == (
        f"could not download {download.MULTI30K_URL}train.de.gz ([Errno -2] Name or service not "
        f"known); put train.de.gz, train.en.gz, val.de.gz, val.en.gz from "
        f"{download.MULTI30K_PAGE} into {tmp_path / 'm'}/ (or point configs/translate.py's "
        "data paths elsewhere)")
    assert not (tmp_path / "m").exists()


def test_a_wrong_download_is_not_kept(tmp_path, monkeypatch):
    files = fake_files()
    files["val.en.gz"] = b"<html>rate limited</html>"
    serve(monkeypatch, files, [])
    with pytest.raises(download.DownloadError, match=r"^downloaded val.en.gz is not a gzip file"):
        download.fetch_multi30k(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.de.gz", "train.en.gz",
                                                          "val.de.gz"]


def test_launch_data_rejects_an_unknown_dataset():
    result = subprocess.run(["bash", str(REPO / "launch.sh"), "data", "wmt99"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "invalid choice: 'wmt99'" in result.stderr and "Warning" not in result.stderr


def test_fresh_clone_configs_read_shipped_or_fetched_data():
    """char_lm reads tinyshakespeare from the package; translate reads what
    ./launch.sh data multi30k writes; neither reads ../shared."""
    path = Path(char_lm.get_config().data.path)
    assert path == ASSETS / "tinyshakespeare.txt" and path.stat().st_size > 1_000_000
    assert path.read_text(encoding="utf-8").startswith("First Citizen:")
    data = translate.get_config().data
    assert [data.source_path, data.target_path, data.eval_source_path, data.eval_target_path] == [
        f"data/multi30k/{name}" for name in download.MULTI30K_FILES]


def test_missing_multi30k_file_names_the_download_step(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"source_path: file not found: .*train.de.gz; "
                                                r"./launch.sh data multi30k downloads it"):
        builders._fingerprint(tmp_path / "data" / "multi30k" / "train.de.gz", "source_path")
