"""Test shim for DeepSpeed 0.10-0.13 on CPU. Their CPU accelerator refuses to start without Intel's extension,
though nothing it does with 2 gloo ranks and DeepSpeed's own CPU Adam calls into it. It is imported as
DeepSpeed picks its accelerator, before the rest of DeepSpeed loads, so it also bridges the torch names
those releases import that torch has since renamed or removed (their elastic agent's, which these tests
never start). Only on the tests' PYTHONPATH for those releases (tests/releases.py); never installed."""
import torch.distributed.elastic.agent.server.api as _agent

if not hasattr(_agent, "log"):  # renamed `logger` in torch 2.2
    _agent.log = _agent.logger
if not hasattr(_agent, "_get_socket_with_port"):  # removed in torch 2.4; only DeepSpeed's elastic agent used it
    def _get_socket_with_port():
        raise NotImplementedError("DeepSpeed's elastic agent is not available beside this torch")

    _agent._get_socket_with_port = _get_socket_with_port


def _gloo_for_the_cpu_accelerator() -> None:
    """Those releases' CPU accelerator names oneCCL ('ccl') as its communication backend, which would build
    and start DeepSpeed's CCL backend; the tests' ranks use gloo, as later releases' CPU accelerator does
    when oneCCL is absent."""
    from deepspeed.accelerator import cpu_accelerator

    original = cpu_accelerator.CPU_Accelerator.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._communication_backend_name = "gloo"

    cpu_accelerator.CPU_Accelerator.__init__ = __init__


_gloo_for_the_cpu_accelerator()
