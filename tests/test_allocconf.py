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
    ("a:1,a:2", "appears twice"),
    ("expandable_segments:True,", "trailing comma"),
    (",x:1", "empty"),
    ("garbage", "not key:value"),
    ("x:", "not key:value"),
])
def test_malformed_settings_are_refused(text, fragment):
    with pytest.raises(allocconf.AllocConfError, match=fragment):
        allocconf.parse("PYTORCH_CUDA_ALLOC_CONF", text)


def test_megatron_core_token_test():
    assert allocconf.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "a:1,expandable_segments:True"})
    assert not allocconf.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
