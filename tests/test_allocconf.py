import pytest

from mbmem_overlays.core import allocconf


def test_merge_keeps_other_keys_and_order():
    new, conflicts = allocconf.merged("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,garbage_collection_threshold:0.8",
                                      {"expandable_segments": "True"})
    assert new == "max_split_size_mb:512,garbage_collection_threshold:0.8,expandable_segments:True"
    assert conflicts == {}


def test_merge_is_idempotent():
    once, _ = allocconf.merged("V", "", {"expandable_segments": "True"})
    twice, _ = allocconf.merged("V", once, {"expandable_segments": "True"})
    assert once == twice == "expandable_segments:True"


def test_explicit_false_is_a_conflict_not_flipped():
    new, conflicts = allocconf.merged("V", "expandable_segments:False", {"expandable_segments": "True"})
    assert conflicts == {"expandable_segments": ("False", "True")}
    assert "expandable_segments:False" in new


@pytest.mark.parametrize("text, fragment", [
    ("expandable_segments:maybe", "must be True or False"),
    ("expandable_segments:true", "must be True or False"),
    ("max_split_size_mb:64,max_split_size_mb:128", "appears twice"),
    ("expandable_segments:True,", "trailing comma"),
    (",x:1", "empty"),
    ("garbage", "not key:value"),
    ("max_split_size_mb:", "not key:value"),
])
def test_malformed_settings_are_refused(text, fragment):
    with pytest.raises(allocconf.AllocConfError, match=fragment):
        allocconf.parse("PYTORCH_CUDA_ALLOC_CONF", text)


def test_megatron_core_token_test():
    assert allocconf.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "a:1,expandable_segments:True"})
    assert not allocconf.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})


# ----------------------------------------------------------------------------- torch 2.14.1's parser as the oracle
# Each string is judged by our parse() and by torch's own parser (torch._C._accelerator_setAllocatorSettings,
# the function torch.cuda.memory._set_allocator_settings calls; it parses without a GPU). Issue 33 #10.
ORACLE_CASES = [
    "expandable_segments:True", "expandable_segments:False", "expandable_segments:true", "expandable_segments:1",
    "expandable_segments:[True]", "bogus:1", "max_split_size_mb:19", "max_split_size_mb:20", "max_split_size_mb:512",
    "max_split_size_mb:20abc", "max_split_size_mb:abc", "max_split_size_mb:99999999999999999999999",
    "max_split_size_mb:[30]", "max_non_split_rounding_mb:19", "max_non_split_rounding_mb:64",
    "large_segment_size_mb:10", "large_segment_size_mb:11", "large_segment_size_mb:64,max_split_size_mb:32",
    "large_segment_size_mb:64,max_split_size_mb:64", "garbage_collection_threshold:0",
    "garbage_collection_threshold:1.0", "garbage_collection_threshold:1", "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:-0.5", "garbage_collection_threshold:nan", "garbage_collection_threshold:inf",
    "garbage_collection_threshold:0x1p-1", "garbage_collection_threshold:.5e0x", "garbage_collection_threshold:1e-400",
    "garbage_collection_threshold:abc", "roundup_power2_divisions:0", "roundup_power2_divisions:3",
    "roundup_power2_divisions:4", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", "roundup_power2_divisions:[256:0]",
    "roundup_power2_divisions:[>:8]", "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[255:1]",
    "roundup_power2_divisions:[0:1]", "roundup_power2_divisions:[1:1]", "roundup_power2_divisions:[x:1]",
    "roundup_power2_divisions:[256:1,]", "backend:native", "backend:foo", "backend:hipMallocAsync",
    "backend:Native", "pinned_num_register_threads:3", "pinned_num_register_threads:128",
    "pinned_num_register_threads:256", "pinned_num_register_threads:0", "per_process_memory_fraction:0",
    "per_process_memory_fraction:1", "per_process_memory_fraction:1.5", "pinned_reserve_segment_size_mb:0",
    "pinned_reserve_segment_size_mb:8", "release_lock_on_cudamalloc:yes", "release_lock_on_hipmalloc:True",
    "pinned_use_cuda_host_register:True", "pinned_use_hip_host_register:False", "pinned_free_catch_all:1",
    "throw_on_cudamalloc_oom:True", "graph_capture_record_stream_reuse:True", "pinned_use_background_threads:Yes",
    "pinned_max_round_threshold_mb:4", "pinned_max_cached_size_mb:0",
    "max_split_size_mb:512,garbage_collection_threshold:0.6,expandable_segments:True",
]
# Deliberately stricter than torch (docs/guarantees.md): a stray comma and a key given twice (torch keeps the last).
STRICTER = ["roundup_power2_divisions:[256:1,]", "expandable_segments:True,", "max_split_size_mb:64,max_split_size_mb:128"]


def _torch_verdicts(cases):
    """{case: accepted} from torch's own parser, in a child process (the parser keeps state: the large segment
    size is reset to its default before each case)."""
    import json
    import subprocess
    import sys
    code = ("import json, sys, torch\nset_ = torch._C._accelerator_setAllocatorSettings\nout = {}\n"
            "for s in json.load(sys.stdin):\n"
            "    set_('large_segment_size_mb:20')\n"
            "    try:\n        set_(s); out[s] = True\n"
            "    except Exception:\n        out[s] = False\nprint(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_values_are_judged_as_torch_2_14_1_judges_them():
    pytest.importorskip("torch")
    torch_says = _torch_verdicts(ORACLE_CASES + STRICTER)
    assert all(torch_says[case] for case in STRICTER)
    torch_says.update({case: False for case in STRICTER})
    disagreements = []
    for case in ORACLE_CASES + STRICTER:
        try:
            allocconf.parse("PYTORCH_CUDA_ALLOC_CONF", case)
            ours = True
        except allocconf.AllocConfError:
            ours = False
        if ours != torch_says[case]:
            disagreements.append((case, "ours", ours, "torch", torch_says[case]))
    assert not disagreements


@pytest.mark.parametrize("text, fragment", [
    ("bogus_key:1", "is not a setting torch knows"),
    ("max_split_size_mb:8", "must be at least 20"),
    ("garbage_collection_threshold:1.5", "strictly between 0 and 1"),
    ("roundup_power2_divisions:3", "power of two"),
    ("backend:cudaMallocAsyncc", "must be one of native, cudaMallocAsync"),
    ("pinned_use_background_threads:yes", "must be True or False"),
])
def test_refusals_name_the_setting_and_a_fix(text, fragment):
    with pytest.raises(allocconf.AllocConfError, match=fragment) as info:
        allocconf.parse("PYTORCH_ALLOC_CONF", text)
    assert "PYTORCH_ALLOC_CONF" in str(info.value) and len(str(info.value)) < 1200


@pytest.mark.parametrize("env, var, base", [
    ({}, None, None),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, "PYTORCH_ALLOC_CONF", "max_split_size_mb:512"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, "PYTORCH_CUDA_ALLOC_CONF", ""),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": "x"}, "PYTORCH_CUDA_ALLOC_CONF",
     "backend:cudaMallocAsync"),
])
def test_the_variable_torch_reads(env, var, base):
    """CUDAAllocatorConfig::instance(): PYTORCH_CUDA_ALLOC_CONF when set (even empty), else PYTORCH_ALLOC_CONF."""
    assert allocconf.var_in_effect(env) == var
    assert allocconf.base_value("PYTORCH_CUDA_ALLOC_CONF", env) == base
