"""The configuration reference: every key described, and docs/configuration.md current."""

import dataclasses
from pathlib import Path

from fedjax_rcl import reference
from fedjax_rcl.reference import attribute_docs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


# Each test starts from a fresh process's registry (only the built-in entries: tests in this
# process may have registered plugins).


def test_every_key_has_a_description(fresh_registry):
    fresh_registry()
    assert [k.key for k in reference.keys() if not k.doc] == []


def test_docs_configuration_md_is_the_generated_reference(fresh_registry):
    fresh_registry()
    generated = reference.markdown()
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
