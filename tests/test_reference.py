"""The configuration reference: every key described, and docs/configuration.md current."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from fedjax_rcl.reference import attribute_docs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _fresh(code: str) -> str:
    """Runs ``code`` in a fresh process: only the built-in entries are registered there (tests
    in this process may have registered plugins)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout


def test_every_key_has_a_description():
    missing = _fresh("from fedjax_rcl import reference\n"
                     "print('\\n'.join(k.key for k in reference.keys() if not k.doc))")
    assert missing.split() == []


def test_docs_configuration_md_is_the_generated_reference():
    generated = _fresh("from fedjax_rcl import reference\nprint(reference.markdown(), end='')")
    assert DOCS.read_text() == generated, (
        "docs/configuration.md is stale: python -m fedjax_rcl.reference > "
        "docs/configuration.md")
    for key in ("seed", "fedrcl.beta", "server.fedadam.tau", "mfcl.bn_statistics",
                "tracking.wandb_mode"):
        assert f"| `{key}` |" in generated
    for values in ("`fp32`, `bf16`, `fp16`", "`hard`, `none`"):  # precision, fedrcl.mining
        assert f"Allowed: {values}." in generated


def test_attribute_docs_reads_google_style_sections():
    @dataclasses.dataclass
    class Section:
        """A section.

        Attributes:
          first, second: shared text
            that continues.
          third: its own.

        Notes:
          not_a_field: outside the section.
        """

        first: int = 0
        second: int = 0
        third: int = 0

    assert attribute_docs(Section) == {"first": "shared text that continues.",
                                       "second": "shared text that continues.",
                                       "third": "its own."}
