"""Build-time reference pages (mkdocs-gen-files): written from the code on every `mkdocs build`, so they
cannot drift from it. The pages are built in reference_pages.py and api_pages.py; the results pages' plots in
plots.py. A name the code gained without a description (an environment variable) fails the build."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mkdocs-gen-files runs this file, not a package

from plots import all_plots  # noqa: E402
from reference_pages import all_pages  # noqa: E402

for name, text in all_pages().items():
    with mkdocs_gen_files.open(f"reference/{name}", "w") as f:
        f.write(text)

for name, svg in all_plots().items():
    with mkdocs_gen_files.open(name, "w") as f:
        f.write(svg)
