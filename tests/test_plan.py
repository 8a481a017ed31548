"""tokenmill plan: model arithmetic, rooflines, KV capacity (against the engine), cost and the CLI."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM
from tokenmill.cli import main
from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import CATALOG, lookup, match_cuda_device
from tokenmill.models.loader import load_model_config
from tokenmill.models.model_math import ModelMath
from tokenmill.plan.planner import PlanInputs, batch_run_seconds, make_plan

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
}


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-8b") / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_llama3_8b_arithmetic(llama3_8b):
    model = ModelMath(load_model_config(llama3_8b))
    assert model.kv_bytes_per_token("bfloat16") == 131072  # 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes
    assert model.num_params == pytest.approx(8.03e9, rel=0.005)
    assert model.weight_bytes("bfloat16") == pytest.approx(16.06e9, rel=0.005)
    # weight-only quantization covers the layers' linear weights; embeddings, LM head, norms stay bf16
    linear = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    rest_bytes = (model.num_params - linear) * 2
    assert model.weight_bytes("bfloat16", "int8") == pytest.approx(linear * (1 + 2 / 32) + rest_bytes)
    assert model.weight_bytes("bfloat16", "int4") == pytest.approx(linear * (0.5 + 2 / 64) + rest_bytes)


def test_h100_bounds_batch_one_decode_near_200_tokens_per_s(llama3_8b):
    model = ModelMath(load_model_config(llama3_8b))
    plan = make_plan(model, PlanInputs(lookup("H100-SXM"), context=1024, concurrency=1, efficiency=1.0))
    assert 190 <= plan.decode_tokens_per_s_bound <= 210
    assert plan.decode_bound_by == "memory"
    # at large batch the compute roof takes over
    big = make_plan(model, PlanInputs(lookup("H100-SXM"), context=1024, concurrency=256, efficiency=1.0))
    assert big.aggregate_decode_tokens_per_s_bound > 50 * plan.decode_tokens_per_s_bound


def test_param_count_matches_real_models(tiny_model_dirs):
    import transformers

    for arch, path in tiny_model_dirs.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
        assert ModelMath(load_model_config(path)).num_params == hf.num_parameters(), arch


def test_kv_capacity_prediction_equals_the_engine_pool(tiny_llama_dir):
    budget = 3_000_000
    model = ModelMath(load_model_config(tiny_llama_dir))
    custom = lookup("L4").with_overrides(memory_gb=1.0)
    plan = make_plan(model, PlanInputs(custom, dtype="float32", context=256, kv_memory_bytes=budget))
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget)
    stats = llm.stats().kv_cache
    assert plan.max_kv_tokens == stats.num_blocks * llm.engine.kv_cache.block_size
    assert plan.max_concurrent_sequences == stats.num_blocks // (256 // 16)
    # a float16 pool under the float32 model (what serve keeps on AVX2 CPUs): twice the tokens
    half = make_plan(model, PlanInputs(custom, dtype="float32", context=256, kv_memory_bytes=budget,
                                       kv_cache_dtype="float16"))
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget, kv_cache_dtype="float16")
    assert half.max_kv_tokens == llm.stats().kv_cache.num_blocks * 16 == 2 * plan.max_kv_tokens


def test_tensor_parallel_and_cost_arithmetic(llama3_8b):
    model = ModelMath(load_model_config(llama3_8b))
    one = make_plan(model, PlanInputs(lookup("A100-80GB"), context=2048, cost_per_hour=2.0, api_price_per_1m=0.5))
    two = make_plan(model, PlanInputs(lookup("A100-80GB"), context=2048, cost_per_hour=2.0, api_price_per_1m=0.5,
                                      tensor_parallel=2))
    assert two.weights_bytes == pytest.approx(one.weights_bytes / 2)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    assert two.cost_per_hour == 4.0
    assert one.break_even_tokens_per_month == pytest.approx(2.0 * 730 / 0.5 * 1e6)
    assert one.cost_per_1m_tokens == pytest.approx(2.0 / (one.aggregate_decode_tokens_per_s_bound * 3600) * 1e6)
    assert one.cost_per_1m_tokens_at_utilization == pytest.approx(one.cost_per_1m_tokens / 0.5)
    with pytest.raises(InvalidParameterError, match="divide"):
        make_plan(model, PlanInputs(lookup("A100-80GB"), tensor_parallel=3))
    with pytest.raises(InvalidParameterError, match="GB per device"):
        make_plan(model, PlanInputs(lookup("L4"), dtype="float32"))


def test_batch_workload_estimate_is_consistent(llama3_8b):
    model = ModelMath(load_model_config(llama3_8b))
    inputs = PlanInputs(lookup("H100-SXM"), efficiency=1.0)
    one_token = batch_run_seconds(model, inputs, 8, 512, 1)
    assert one_token == pytest.approx(8 * 512 * model.flops_per_token(256) / 989e12)  # prefill only
    assert batch_run_seconds(model, inputs, 8, 512, 65) > one_token


def test_catalog_and_device_matching():
    for name in ("L4", "A10G", "A100-40GB", "A100-80GB", "H100-SXM", "H200", "MI300X"):
        entry = CATALOG[name.lower()]
        assert entry.memory_gb > 0 and entry.bandwidth_gbs > 0 and entry.bf16_tflops > 0 and entry.price_per_hour > 0
    assert match_cuda_device("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert match_cuda_device("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert match_cuda_device("NVIDIA L40S") is None
    with pytest.raises(InvalidParameterError, match="unknown accelerator"):
        lookup("TPU-v9")


def test_cli_json(llama3_8b, capsys):
    assert main(["plan", "--model", str(llama3_8b), "--gpu", "H100-SXM", "--context", "8192",
                 "--api-price-per-1m", "0.6", "--batch-workload", "64x256x128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("kv_bytes_per_token", "weights_bytes", "max_concurrent_sequences", "decode_tokens_per_s_bound",
                "cost_per_1m_tokens", "break_even_tokens_per_month", "batch_workload"):
        assert key in result
    assert result["kv_bytes_per_token"] == 131072 and result["accelerator"]["name"] == "H100-SXM"
    assert main(["plan", "--model", str(llama3_8b), "--memory-gb", "48", "--bandwidth-gbs", "900",
                 "--tflops", "180", "--cost-per-hour", "1.2"]) == 0
    assert "sequences that fit" in capsys.readouterr().out
    assert main(["plan", "--model", str(llama3_8b), "--gpu", "L4", "--dtype", "float32"]) == 2
    assert "GB per device" in capsys.readouterr().err
