"""Reading one series out of a server's ``/metrics`` text, over all its label sets or chosen ones."""

from __future__ import annotations

from kvpolicy.harness.server import metric_value

TEXT = """\
# HELP vllm:mooncake_store_operation_time_seconds_bucket Histogram of Mooncake store communication time.
vllm:mooncake_store_operation_time_seconds_bucket{engine="0",le="4.0",model_name="/m,odel",operation="load_get",status="ok"} 10.0
vllm:mooncake_store_operation_time_seconds_bucket{engine="0",le="+Inf",model_name="/m,odel",operation="load_get",status="ok"} 12.0
vllm:mooncake_store_operation_time_seconds_bucket{engine="0",le="+Inf",model_name="/m,odel",operation="save_put",status="ok"} 5.0
vllm:mooncake_store_operation_time_seconds_bucket{engine="0",le="+Inf",model_name="/m,odel",operation="load_get",status="error"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running_total 100.0
"""


def test_without_labels_every_label_set_of_the_series_is_summed() -> None:
    assert metric_value(TEXT, "vllm:mooncake_store_operation_time_seconds_bucket") == 28.0


def test_a_longer_series_name_is_not_the_series() -> None:
    assert metric_value(TEXT, "vllm:num_requests_running") == 3.0


def test_labels_keep_only_the_samples_that_carry_them() -> None:
    series = "vllm:mooncake_store_operation_time_seconds_bucket"
    assert metric_value(TEXT, series, le="+Inf", operation="load_get") == 13.0
    assert metric_value(TEXT, series, le="+Inf", operation="load_get", status="ok") == 12.0
    assert metric_value(TEXT, series, le="4.0", operation="save_put") == 0.0


def test_a_comma_inside_a_label_value_does_not_split_the_labels() -> None:
    assert metric_value(TEXT, "vllm:mooncake_store_operation_time_seconds_bucket", model_name="/m,odel", le="4.0") == 10.0
