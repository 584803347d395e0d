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

# Where a generated page's edit link points (relative to docs/): the code it is generated from.
SOURCES = {"cli.md": "../flows/cli.py", "settings": "../core/spec/settings.py",
           "stage-kinds.md": "../core/spec/kinds.py",
           "api/contracts.md": "../core/contracts.py", "api/rl.md": "../core/rl/algorithm.py",
           "api/environments.md": "../core/environments/contract.py", "api/python.md": "../flows/api.py"}

for name, text in all_pages().items():
    with mkdocs_gen_files.open(f"reference/{name}", "w") as f:
        f.write(text)
    source = SOURCES.get(name) or SOURCES.get(name.split("/")[0].removesuffix(".md"))
    mkdocs_gen_files.set_edit_path(f"reference/{name}", source or "scripts/reference_pages.py")

for name, svg in all_plots().items():
    with mkdocs_gen_files.open(name, "w") as f:
        f.write(svg)
