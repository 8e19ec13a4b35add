"""Fetches the raw files of datasets that cannot ship inside the package: `./launch.sh data NAME`.

    ./launch.sh data multi30k              # into data/multi30k/, where configs/translate.py reads
    python -m tfm.data.download multi30k --dir /elsewhere

Multi30k (Elliott et al. 2016, task 1: 29,000 training and 1,014 validation German-English
caption pairs) comes from the official repository, github.com/multi30k/dataset. Offline, or when
a download fails, it says in one line which files to put where. tinyshakespeare needs no step:
it ships with the package (tfm/data/assets/).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
MULTI30K_PAGE = "https://github.com/multi30k/dataset/tree/master/data/task1/raw"
# File name -> number of lines: a truncated download or an HTML error page fails the check.
MULTI30K_FILES = {
    "train.de.gz": 29_000,
    "train.en.gz": 29_000,
    "val.de.gz": 1_014,
    "val.en.gz": 1_014,
}
DATASETS = ("multi30k",)
DEFAULT_DIRS = {"multi30k": Path("data") / "multi30k"}


def hint(missing: Path) -> str | None:
    """How to get `missing` if it is one of the files `./launch.sh data` fetches."""
    if missing.name in MULTI30K_FILES:
        return "./launch.sh data multi30k downloads it (or says where to put it)"
    return None


class DownloadError(RuntimeError):
    """A file could not be fetched or is not what it should be; the message is one line."""


def _check(name: str, data: bytes, expected_lines: int) -> None:
    try:
        lines = gzip.decompress(data).decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise DownloadError(f"{name} is not a gzip file of UTF-8 text ({error})") from None
    if len(lines) != expected_lines:
        raise DownloadError(f"{name} has {len(lines)} lines; the official file has "
                            f"{expected_lines}")


def fetch_multi30k(directory: str | os.PathLike, timeout: float = 30.0) -> list[Path]:
    """Downloads the four Multi30k task-1 files into `directory` (files already there and
    complete are kept); returns their paths. Raises DownloadError with a one-line message
    naming the files and where to put them when offline or when a file is wrong."""
    directory = Path(directory)
    where = (f"put {', '.join(MULTI30K_FILES)} from {MULTI30K_PAGE} into {directory}/ "
             "(or point configs/translate.py's data paths elsewhere)")
    paths = []
    for name, lines in MULTI30K_FILES.items():
        path = directory / name
        paths.append(path)
        if path.exists():
            try:
                _check(name, path.read_bytes(), lines)
                continue
            except DownloadError as error:
                raise DownloadError(f"{path} is there but wrong: {error}; delete it to download "
                                    "it again") from None
        try:
            with urllib.request.urlopen(MULTI30K_URL + name, timeout=timeout) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise DownloadError(f"could not download {MULTI30K_URL + name} ({reason}); {where}"
                                ) from None
        try:
            _check(name, data, lines)
        except DownloadError as error:
            raise DownloadError(f"downloaded {error}; {where}") from None
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)  # a kill mid-write leaves no half file under the real name
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./launch.sh data", description=__doc__.split("\n")[0])
    parser.add_argument("dataset", choices=DATASETS)
    parser.add_argument("--dir", default=None, help="target directory (default data/<dataset>)")
    args = parser.parse_args(argv)
    directory = Path(args.dir) if args.dir else DEFAULT_DIRS[args.dataset]
    try:
        paths = fetch_multi30k(directory)
    except DownloadError as error:
        sys.stderr.write(f"tfm.data.download {args.dataset}: {error}\n")
        return 1
    print(f"{args.dataset}: {', '.join(str(p) for p in paths)} ready; train with "
          "./launch.sh train configs/translate.py:small")
    return 0


if __name__ == "__main__":
    sys.exit(main())
