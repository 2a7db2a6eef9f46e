"""radixserve: an LLM serving engine with a radix-tree prefix cache and a continuous-batching scheduler."""

from radixserve.config.server_args import ServerArgs
from radixserve.protocol.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]


def __getattr__(name: str) -> object:
    # Importing the engine pulls in torch and transformers; keep `import radixserve` light.
    if name == "Engine":
        from radixserve.runtime.engine import Engine

        return Engine
    raise AttributeError(name)
