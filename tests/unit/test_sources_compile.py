"""Every Python source of the project compiles with warnings as errors: an invalid escape in a string (`"\\s"` in a
docstring) is a DeprecationWarning on 3.11, a SyntaxWarning printed at import on 3.12 (the GPU machines' Python) and
slated to become a SyntaxError."""
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "serve_app", "benchmarks", "loadtest", "cluster", "tests")


def test_every_source_compiles_without_a_warning():
    sources = [path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 200
    failed = {}
    for path in sources:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec", dont_inherit=True)
            except SyntaxError as error:  # a warning raised as an error arrives as a SyntaxError
                failed[str(path.relative_to(ROOT))] = str(error)
    assert not failed, failed
