"""The line the zoo sweep names a failed engine by (:func:`kvpolicy.harness.zoo.observe.error_line`),
from tracebacks Python and pydantic really print."""

from __future__ import annotations

import runpy
import subprocess
import traceback
from pathlib import Path

import pydantic
import pytest

from kvpolicy.harness.zoo.observe import error_line


class Config(pydantic.BaseModel):
    mamba_block_size: int | None = None
    enable_prefix_caching: bool = False

    @pydantic.model_validator(mode="after")
    def _block_size_needs_prefix_caching(self) -> Config:
        if self.mamba_block_size is not None and not self.enable_prefix_caching:
            raise ValueError("--mamba-block-size can only be set with --enable-prefix-caching")
        return self


def printed(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def raised(function) -> BaseException:
    with pytest.raises(BaseException) as caught:
        function()
    return caught.value


def test_a_pydantic_validation_error_is_named_with_what_failed_not_only_its_count() -> None:
    text = printed(raised(lambda: Config(mamba_block_size=16)))
    line = error_line("", text)
    assert line.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for Config")
    assert line.endswith("--mamba-block-size can only be set with --enable-prefix-caching")


def test_the_last_exception_of_the_childs_own_traceback_names_the_failure() -> None:
    def load() -> None:
        raise KeyError("blocks.0.ffn.experts.w13_weight")

    assert error_line("", printed(raised(load))) == "KeyError: 'blocks.0.ffn.experts.w13_weight'"


def test_a_bare_assertion_says_where_and_what_it_asserted(tmp_path: Path) -> None:
    # A module of its own, as vLLM's are: pytest rewrites the asserts of test modules only.
    module = tmp_path / "cpu_router.py"
    module.write_text('def route(scoring_func):\n    assert scoring_func == "softmax"\n')
    route = runpy.run_path(str(module))["route"]
    line = error_line("", printed(raised(lambda: route("sigmoid"))))
    assert line == f'AssertionError at {module}:2 (assert scoring_func == "softmax")'


def test_a_failure_inside_a_subprocess_vllm_ran_is_named_by_the_subprocesss_own_error() -> None:
    # vLLM inspects a model in a subprocess and re-raises its stderr inside a RuntimeError, logging the
    # whole chain at ERROR: the wrappers say only that another process failed.
    def inspect_model() -> None:
        try:
            raise ModuleNotFoundError("No module named 'torchvision'")
        except ModuleNotFoundError as inner:
            child_stderr = printed(inner)
        try:
            raise subprocess.CalledProcessError(1, ["python", "-m", "vllm.model_executor.models.registry"])
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"Error raised in subprocess:\n{child_stderr}") from error

    logged = "\n".join(f"(MainProcess pid=1) ERROR 12-07 11:02:19 [registry.py:1120] {line}"
                       for line in printed(raised(inspect_model)).splitlines())
    assert error_line(logged, "") == "ModuleNotFoundError: No module named 'torchvision'"
