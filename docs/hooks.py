"""MkDocs hook: serve the committed figures of experiments/results/ in the site, so pages show
them without a second copy under docs/."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    for path in sorted((ROOT / "experiments" / "results").rglob("*.png")):
        files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"],
                          config["use_directory_urls"]))
    return files
