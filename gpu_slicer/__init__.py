"""gpu-slicer: exclusive, connection-bound GPU turns for a trainer and its vLLM sampler.

The installed import names live under this namespace so that they coexist with PyPI's
``slicer`` and ``proto-plus`` in one environment. In a checkout the code lives in the
top-level folders ``proto/``, ``slicer/``, ``launcher/`` and ``dispatcher/``; the entries
of this folder are links to them (ARCHITECTURE.md). Import them as ``gpu_slicer.proto``,
``gpu_slicer.slicer`` (``from gpu_slicer.slicer.client import Slicer``), and so on.
"""

__version__ = "0.1.0"
