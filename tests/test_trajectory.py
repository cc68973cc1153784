from gateway.trajectory import Trajectory, Turn, build_segments


def turn(prompt, out, version=0):
    return Turn(prompt, out, [-0.5] * len(out), [version] * len(out), "stop")


def test_multi_turn_merges_into_one_segment():
    t1 = turn([1, 2, 3], [4, 5])
    t2 = turn([1, 2, 3, 4, 5, 6, 7], [8], version=1)  # tool result 6, 7 rendered by the gateway
    segments, forks = build_segments([t1, t2])
    assert forks == 0 and len(segments) == 1
    s = segments[0]
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]


def test_diverging_history_forks_but_siblings_do_not():
    a = turn([1, 2], [3])
    sibling = turn([1, 2], [9])  # n > 1: same prompt, another sample
    edited = turn([1, 7, 3, 4], [5])  # history edited: extends nothing
    cont = turn([1, 2, 9, 10], [11])  # continues the sibling
    segments, forks = build_segments([a, sibling, edited, cont])
    assert forks == 1
    assert [s.token_ids for s in segments] == [[1, 2, 3], [1, 2, 9, 10, 11], [1, 7, 3, 4, 5]]


def test_round_trip_dict():
    traj = Trajectory("s1", reward=1.0, turns=[turn([1], [2])])
    traj.rebuild_segments()
    again = Trajectory.from_dict(traj.to_dict())
    assert again == traj and again.num_output_tokens == 1
