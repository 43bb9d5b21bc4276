from services.common.ids import experience_id, id_age_seconds, new_id


def test_ids_carry_their_age_and_sort_by_time():
    a = new_id("chatcmpl")
    assert a.startswith("chatcmpl-")
    age = id_age_seconds(a)
    assert age is not None and -1 < age < 5
    assert id_age_seconds(experience_id(a, 3)) is not None
    assert id_age_seconds("not-an-id") is None
    assert id_age_seconds("chatcmpl-xyz") is None
    # 12 hex digits of milliseconds: later ids compare greater
    older = "chatcmpl-000000000001" + "0" * 12
    assert older < a
    assert id_age_seconds(older) > 1e9
