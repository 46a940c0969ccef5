"""The tuned-config store and the config choice that reads it."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.kernel import heuristics, tuned
from megamoe_cli.layout import PRESETS

DSV3 = PRESETS["deepseek-v3"]
QWEN = PRESETS["qwen3-235b"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    return path


def _entry(shape, tokens, config, time_us=100.0, default_time_us=150.0, world_size=8, gpu="H200"):
    key = tuned.make_key(gpu, world_size, shape, tokens)
    return tuned.make_entry(key, config, time_us, default_time_us, date="2026-01-01T00:00:00+00:00", commit="abc123")


@pytest.mark.parametrize(
    "tokens, bucket",
    [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128), (1000, 1024), (1024, 1024), (1025, 2048), (8192, 8192)],
)
def test_token_bucket_is_next_power_of_two(tokens, bucket):
    assert tuned.token_bucket(tokens) == bucket


def test_token_bucket_rejects_negative():
    with pytest.raises(MegaMoEError):
        tuned.token_bucket(-1)


def test_default_path_honours_environment(store):
    assert tuned.default_path() == store


def test_default_path_without_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(tuned.ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tuned.default_path() == tmp_path / ".cache" / "megamoe" / "tuned.json"


def test_key_uses_bucket_and_canonical_gpu_name():
    a = tuned.make_key("NVIDIA H200", 8, DSV3, 3000)
    b = tuned.make_key("H200", 8, DSV3, 4096)
    assert a == b
    assert str(a) == "H200/ws8/h7168/i2048/e256/k8/fp8_e4m3/t4096"
    assert tuned.make_key("H200", 8, DSV3, 4097) != a


def test_entry_records_evidence():
    entry = _entry(DSV3, 128, {"num_stages": 6}, time_us=80.0, default_time_us=120.0)
    assert entry["speedup"] == pytest.approx(1.5)
    assert entry["time_us"] == 80.0 and entry["default_time_us"] == 120.0
    assert entry["date"] == "2026-01-01T00:00:00+00:00" and entry["commit"] == "abc123"
    assert entry["key"]["token_bucket"] == 128
    with pytest.raises(MegaMoEError, match="must be positive"):
        tuned.make_entry(tuned.make_key("H200", 8, DSV3, 128), {}, 0.0, 2.0, date="d", commit="c")


def test_missing_store_is_empty(store):
    assert tuned.load() == {}
    assert tuned.lookup(tuned.make_key("H200", 8, DSV3, 128)) is None


def test_merge_keeps_other_keys_and_replaces_same_key(store):
    tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 3}), _entry(QWEN, 1024, {"num_stages": 5})])
    tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 6}), _entry(DSV3, 8192, {"num_sms": 120})])
    entries = tuned.load()
    assert len(entries) == 3
    assert tuned.lookup(tuned.make_key("H200", 8, DSV3, 100)) == {"num_stages": 6}
    assert tuned.lookup(tuned.make_key("H200", 8, QWEN, 1000)) == {"num_stages": 5}
    assert tuned.lookup(tuned.make_key("H200", 8, DSV3, 8000)) == {"num_sms": 120}
    assert json.loads(store.read_text())["version"] == tuned.FORMAT_VERSION
    assert not [p for p in store.parent.iterdir() if p.suffix == ".tmp"]


def test_failed_replace_leaves_old_file_and_no_temp(store, monkeypatch):
    tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 3})])
    before = store.read_bytes()

    def fail_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(tuned.os, "replace", fail_replace)
    with pytest.raises(OSError, match="disk gone"):
        tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 7})])
    assert store.read_bytes() == before
    assert sorted(p.name for p in store.parent.iterdir()) == ["tuned.json", "tuned.json.lock"]


def test_crash_between_temp_write_and_replace_leaves_old_file(store):
    tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 3})])
    before = store.read_bytes()
    # A process that dies (no cleanup, no exception handling) right where the rename would happen.
    script = textwrap.dedent(
        """
        import os
        from megamoe_cli.kernel import tuned
        from megamoe_cli.layout import PRESETS

        def die(src, dst):
            assert os.path.getsize(src) > 0
            os._exit(9)

        os.replace = die
        key = tuned.make_key("H200", 8, PRESETS["deepseek-v3"], 128)
        tuned.merge_and_save([tuned.make_entry(key, {"num_stages": 7}, 1.0, 2.0, date="d", commit="x")])
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), timeout=120)
    assert proc.returncode == 9
    assert store.read_bytes() == before
    assert tuned.lookup(tuned.make_key("H200", 8, DSV3, 128)) == {"num_stages": 3}
    # The orphaned temp file does not stop the next writer.
    tuned.merge_and_save([_entry(DSV3, 128, {"num_stages": 7})])
    assert tuned.lookup(tuned.make_key("H200", 8, DSV3, 128)) == {"num_stages": 7}


def test_corrupt_store_names_file_line_and_column(store):
    store.parent.mkdir(parents=True)
    store.write_text('{\n  "version": 1,\n  "entries": {,}\n}\n')
    with pytest.raises(MegaMoEError) as info:
        tuned.load()
    message = str(info.value)
    assert str(store) in message
    assert "line 3, column 15" in message
    with pytest.raises(MegaMoEError):
        tuned.merge_and_save([_entry(DSV3, 128, {})])
    assert store.read_text().startswith('{\n  "version": 1,\n  "entries": {,}')


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", "must be a JSON object"),
        ('{"version": 1}', "must be a JSON object"),
        ('{"version": 99, "entries": {}}', "version 99"),
        ('{"version": 1, "entries": {"k": {"time_us": 1}}}', "entry 'k' has no \"config\""),
    ],
)
def test_invalid_store_is_a_clear_error(store, content, message):
    store.parent.mkdir(parents=True)
    store.write_text(content)
    with pytest.raises(MegaMoEError, match=message):
        tuned.load()


def test_choose_config_falls_back_to_default(store):
    config, source = heuristics.choose_config(DSV3, 8, 128, "H200")
    assert source == "default"
    assert config == heuristics.default_config(DSV3, 8, 128, "H200")
    assert set(config) >= {"block_m", "num_stages", "num_sms"}
    assert config["block_m"] == 64
    assert config["num_sms"] is None


def test_choose_config_uses_exact_bucket_only(store):
    tuned.merge_and_save([_entry(DSV3, 1024, {"num_sms": 128})])
    config, source = heuristics.choose_config(DSV3, 8, 1000, "H200")
    assert source == "tuned"
    assert config["num_sms"] == 128
    # Knobs the tuned entry lacks come from the default.
    assert config["num_stages"] == heuristics.default_config(DSV3, 8, 1000, "H200")["num_stages"]
    assert heuristics.choose_config(DSV3, 8, 1025, "H200")[1] == "default"
    assert heuristics.choose_config(DSV3, 4, 1000, "H200")[1] == "default"
    assert heuristics.choose_config(DSV3, 8, 1000, "H100")[1] == "default"
    assert heuristics.choose_config(DSV3, 8, 1000, "H200", dtype="bf16")[1] == "default"


def test_default_config_rejects_unknown_gpu():
    with pytest.raises(MegaMoEError, match="unknown GPU"):
        heuristics.default_config(DSV3, 8, 128, "A100")


def test_block_m_rule_picks_smallest_block_holding_expected_rows(monkeypatch):
    # deepseek-v3, 8 ranks: 8 tokens/rank -> 8*8*8/256 = 2 rows per expert; 300 -> 75; 8192 -> 2048.
    assert heuristics.expected_tokens_per_expert(DSV3, 8, 8) == 2
    assert heuristics.expected_tokens_per_expert(DSV3, 8, 300) == 75
    assert heuristics.expected_tokens_per_expert(DSV3, 8, 8192) == 2048
    # The smallest block only while half of it holds the rows (2 ranks: 1024 tokens -> 64 rows,
    # 512 -> 32, 520 -> 32.5): block_m 128 runs its narrow blocks as two 64-row halves.
    assert heuristics.default_config(DSV3, 2, 512, "H200")["block_m"] == 64
    assert heuristics.default_config(DSV3, 2, 520, "H200")["block_m"] == 128
    assert heuristics.default_config(DSV3, 2, 1024, "H200")["block_m"] == 128
    assert heuristics.default_config(DSV3, 2, 8192, "H200")["block_m"] == 128
    monkeypatch.setattr(heuristics, "SUPPORTED_BLOCK_M", (64, 128, 256))
    assert heuristics.default_config(DSV3, 8, 8, "H200")["block_m"] == 64
    assert heuristics.default_config(DSV3, 8, 300, "H200")["block_m"] == 128
    assert heuristics.default_config(DSV3, 8, 8192, "H200")["block_m"] == 256


def test_mxfp4_takes_block_m_64_with_five_stages_up_to_eight_rows_per_expert():
    fp4 = dataclasses.replace(DSV3, weights="fp4")
    # 1 rank: 1 token -> 8/256 = 0.03 rows per expert; 32 -> 1; 256 -> 8; 512 -> 16; 8192 -> 256
    picks = {t: heuristics.default_config(fp4, 1, t, "H200") for t in (1, 32, 256, 512, 8192)}
    assert {t: (c["block_m"], c["num_stages"]) for t, c in picks.items()} == {
        1: (64, 5), 32: (64, 5), 256: (64, 5), 512: (128, 4), 8192: (128, 4)}
    assert all(c["cluster_m"] == 1 for c in picks.values())
    assert heuristics.default_config(fp4, 2, 128, "H200")["block_m"] == 64  # 2 ranks x 128 tokens: 8 rows
    assert heuristics.default_config(fp4, 2, 256, "H200")["block_m"] == 128  # 16 rows
    assert heuristics.default_config(fp4, 1, 8192, "H200", max_block_m=64)["block_m"] == 64
    # a block_m MXFP4 does not build (a future 256) is never chosen for it
    assert heuristics._block_m_fp4(256.0, (64, 128, 256)) == 128
    # FP8 keeps its rule: the smallest block while half of it holds the rows
    assert heuristics.default_config(DSV3, 1, 128, "H200")["block_m"] == 64


# Hopper's opt-in dynamic shared memory per block: 227 KiB.
SM90_MAX_SMEM_BYTES = 227 * 1024


@pytest.mark.parametrize("preset_name", sorted(PRESETS))
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_default_config_is_a_buildable_kernel_variant(preset_name, world_size):
    from megamoe_cli.kernel.kernel_source import KernelConfig, Variant, smem_bytes

    shape = PRESETS[preset_name]
    if shape.num_experts % world_size:
        pytest.skip("experts not divisible by ranks")
    config = heuristics.default_config(shape, world_size, 8192, "H200")
    KernelConfig(block_m=config["block_m"], num_stages=config["num_stages"], num_sms=config["num_sms"] or 0).validate()
    variant = Variant(shape, world_size, 8192, config["block_m"], config["num_stages"])
    assert smem_bytes(variant) <= SM90_MAX_SMEM_BYTES


def test_non_utf8_store_is_named(store):
    store.parent.mkdir(parents=True)
    store.write_bytes(b'{"version": 1, "entries": {"\xff": {}}}')
    with pytest.raises(MegaMoEError, match=r"not UTF-8 text \(byte 28\)"):
        tuned.load()


def test_fp4_weights_have_their_own_key_and_fp8_keys_are_unchanged():
    import dataclasses

    from megamoe_cli.kernel.tuned import TunedKey, make_key
    from megamoe_cli.layout import PRESETS

    fp8 = make_key("H200", 2, PRESETS["deepseek-v3"], 128)
    fp4 = make_key("H200", 2, dataclasses.replace(PRESETS["deepseek-v3"], weights="fp4"), 128)
    assert str(fp8) == "H200/ws2/h7168/i2048/e256/k8/fp8_e4m3/t128" and str(fp4) != str(fp8)
    assert "/wfp4/" in str(fp4)
    old_entry_key = {k: v for k, v in dataclasses.asdict(fp8).items() if k != "weights"}
    assert str(TunedKey(**old_entry_key)) == str(fp8)  # entries written before the format existed
