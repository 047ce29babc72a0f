"""get_minibatch_indices: a partition of range(n) into equal minibatches, shuffled across them by the generator,
and the refusal of a ragged split."""

import torch

from tests.support import (aside, assert_equal, assert_raises, each_refusal, assert_reproducible, calling, exercise,
                           expect)


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_partition(impl):
    for n, size in ((12, 4), (6, 6), (5, 1)):
        batches = calling(impl.get_minibatch_indices, n, size, torch.Generator().manual_seed(0),
                             what=f"get_minibatch_indices({n}, {size})")
        expect(isinstance(batches, (list, tuple)) and all(isinstance(b, torch.Tensor) for b in batches),
               f"what get_minibatch_indices({n}, {size}) returns", "expected a list of index tensors",
               observed=type(batches).__name__)
        assert_equal([len(b) for b in batches], [size] * (n // size),
                     f"the sizes of the minibatches of get_minibatch_indices({n}, {size})",
                     hint=f"{n} samples in minibatches of {size}: {n // size} minibatches of {size} each")
        assert_equal(sorted(torch.cat(list(batches)).tolist()), list(range(n)),
                     f"the indices of get_minibatch_indices({n}, {size}), sorted",
                     hint="every index must appear exactly once. Usually: drawn with replacement (torch.randint) "
                          "rather than a permutation (torch.randperm), or minibatches that overlap or leave some out")


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_are_shuffled_and_seeded(impl):
    assert_reproducible(impl.get_minibatch_indices, 12, 4, what="get_minibatch_indices(12, 4, generator)")
    orders = [torch.cat(list(impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(s)))).tolist()
              for s in range(8)]
    expect(list(range(12)) not in orders, "the order of get_minibatch_indices(12, 4)",
           "some seed gave the indices in order 0, 1, ..., 11: shuffle them (torch.randperm(n, generator=...))",
           observed=orders)
    homes = {next(i for i, b in enumerate(impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(s)))
                  if 0 in b.tolist()) for s in range(8)}
    expect(len(homes) > 1, "which minibatch index 0 lands in, over 8 seeds",
           f"index 0 landed in minibatch {sorted(homes)} for all 8 seeds, where a shuffle across the 3 minibatches "
           "puts it in each with probability 1/3" + aside(
               "Common cause: the indices shuffled only within each minibatch, where one permutation of range(n), "
               "then split, shuffles them across minibatches."), observed=sorted(homes))


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_refuses_a_ragged_split(impl):
    with each_refusal():
        for n, size in ((10, 4), (3, 5)):
            assert_raises(ValueError, impl.get_minibatch_indices, n, size, torch.Generator().manual_seed(0),
                          what=f"get_minibatch_indices({n}, {size})",
                          why="n must be a multiple of minibatch_size, or some samples would be dropped or repeated")
