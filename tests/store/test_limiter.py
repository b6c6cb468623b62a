"""ByteLimiter: one byte budget shared by every task of a save or restore."""

import asyncio

import numpy as np
import pytest

from ckpt.store.limiter import ByteLimiter

TIMEOUT_S = 10.0  # a deadlock fails the test instead of hanging it


def run(coro):
  return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def settle(n=5):
  for _ in range(n):
    await asyncio.sleep(0)


def test_rejects_non_positive_budget():
  for bad in (0, -1):
    with pytest.raises(ValueError, match="positive"):
      ByteLimiter(bad)


def test_over_release_is_an_error():
  async def main():
    lim = ByteLimiter(10)
    g = await lim.acquire(4)
    lim.release(g)
    with pytest.raises(RuntimeError, match="more than it granted"):
      lim.release(1)
  run(main())


def test_never_exceeds_budget_across_many_tasks(rng):
  budget = 1000
  sizes = [int(s) for s in rng.integers(1, 700, size=300)]
  sizes[::37] = [budget * 3] * len(sizes[::37])  # a few oversized items
  delays = rng.random(len(sizes)) * 2e-3

  async def main():
    lim = ByteLimiter(budget)
    state = {"held": 0, "max_held": 0, "holders": 0, "max_holders": 0,
             "big_with_others": 0, "big_held": False}

    async def one(n, delay):
      grant = await lim.acquire(n)
      assert grant == min(n, budget)
      state["held"] += grant
      state["holders"] += 1
      state["max_held"] = max(state["max_held"], state["held"])
      state["max_holders"] = max(state["max_holders"], state["holders"])
      # Granted but not yet resumed waiters count too, so in_use >= held.
      assert state["held"] <= lim.in_use <= budget
      if n > budget:
        state["big_held"] = True
      if state["big_held"] and state["holders"] > 1:
        state["big_with_others"] += 1
      await asyncio.sleep(delay)
      state["held"] -= grant
      state["holders"] -= 1
      if n > budget:
        state["big_held"] = False
      lim.release(grant)

    await asyncio.gather(*(one(n, d) for n, d in zip(sizes, delays)))
    assert lim.in_use == 0
    return state, lim.peak_in_use

  state, peak = run(main())
  assert state["max_held"] <= peak <= budget
  # It really ran tasks side by side (not one at a time)...
  assert state["max_holders"] >= 3
  # ...but an oversized item always ran alone.
  assert state["big_with_others"] == 0


def test_item_larger_than_budget_proceeds_alone():
  async def main():
    lim = ByteLimiter(100)
    # Alone: takes the whole budget at once.
    g = await asyncio.wait_for(lim.acquire(10_000), 1.0)
    assert g == 100 and lim.in_use == 100
    lim.release(g)
    # Exactly the budget (T5X's `available > n` deadlocks on this one).
    g = await asyncio.wait_for(lim.acquire(100), 1.0)
    lim.release(g)
    # Behind smaller items in flight: waits for them, then proceeds.
    small = [await lim.acquire(30) for _ in range(3)]
    big = asyncio.create_task(lim.acquire(500))
    await settle()
    assert not big.done()
    for s in small:
      lim.release(s)
    g = await asyncio.wait_for(big, 1.0)
    assert g == 100 and lim.in_use == 100
    lim.release(g)
    assert lim.in_use == 0
  run(main())


def test_fifo_order_and_no_starvation_of_large_items():
  async def main():
    lim = ByteLimiter(100)
    order = []

    async def take(name, n, hold):
      g = await lim.acquire(n)
      order.append(name)
      await hold.wait()
      lim.release(g)

    hold_first, hold_rest = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(take("first", 60, hold_first))
    await settle()
    big = asyncio.create_task(take("big", 80, hold_rest))
    await settle()
    # 40 bytes are free and `small` fits, but it must queue behind `big`.
    smalls = []
    for i in range(5):
      smalls.append(asyncio.create_task(take(f"small{i}", 10, hold_rest)))
      await settle()
    assert order == ["first"]
    hold_first.set()
    await settle(20)
    # big first, then the small ones in arrival order, as far as they fit.
    assert order == ["first", "big", "small0", "small1"]
    hold_rest.set()
    await asyncio.gather(first, big, *smalls)
    assert order == ["first", "big"] + [f"small{i}" for i in range(5)]
    assert lim.in_use == 0
  run(main())


def test_cancelled_waiter_gives_its_place_back():
  async def main():
    lim = ByteLimiter(100)
    g = await lim.acquire(100)
    waiter = asyncio.create_task(lim.acquire(50))
    behind = asyncio.create_task(lim.acquire(100))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
      await waiter
    lim.release(g)
    # `behind` gets the whole budget: the cancelled waiter took nothing.
    assert await asyncio.wait_for(behind, 1.0) == 100
    lim.release(100)
    assert lim.in_use == 0
  run(main())


def test_cancelled_after_grant_returns_the_bytes():
  async def main():
    lim = ByteLimiter(100)
    g = await lim.acquire(100)
    waiter = asyncio.create_task(lim.acquire(70))
    await settle()
    lim.release(g)          # grants 70 to the waiter...
    assert lim.in_use == 70
    waiter.cancel()         # ...which is cancelled before it resumes.
    with pytest.raises(asyncio.CancelledError):
      await waiter
    assert lim.in_use == 0  # the grant came back
    assert await asyncio.wait_for(lim.acquire(100), 1.0) == 100
  run(main())


def test_cancel_then_release_before_the_waiter_runs():
  # The waiter is cancelled and, before its task runs again, a release pops
  # its (cancelled) future off the queue. It must still end in
  # CancelledError, and the next waiter must be served.
  async def main():
    lim = ByteLimiter(100)
    g = await lim.acquire(100)
    waiter = asyncio.create_task(lim.acquire(50))
    behind = asyncio.create_task(lim.acquire(60))
    await settle()
    waiter.cancel()
    lim.release(g)
    with pytest.raises(asyncio.CancelledError):
      await waiter
    assert await asyncio.wait_for(behind, 1.0) == 60
    assert lim.in_use == 60
  run(main())


def test_zero_bytes_never_waits():
  async def main():
    lim = ByteLimiter(8)
    g = await lim.acquire(8)
    assert await asyncio.wait_for(lim.acquire(0), 1.0) == 0
    lim.release(g)
  run(main())


def test_random_cancellations_never_leak_bytes(rng):
  plan = [(int(n), bool(c), float(d)) for n, c, d in
          zip(rng.integers(1, 400, 200), rng.random(200) < 0.3,
              rng.random(200) * 1e-3)]

  async def main():
    lim = ByteLimiter(500)

    async def one(n, d):
      g = await lim.acquire(n)
      try:
        assert lim.in_use <= 500
        await asyncio.sleep(d)
      finally:
        lim.release(g)

    tasks = [asyncio.create_task(one(n, d)) for n, _, d in plan]
    await asyncio.sleep(1e-3)
    for t, (_, cancel, _) in zip(tasks, plan):
      if cancel:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    bad = [r for r in results if isinstance(r, BaseException)
           and not isinstance(r, asyncio.CancelledError)]
    assert not bad, bad
    assert lim.in_use == 0
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) > 0
  run(main())


def test_budget_is_shared_not_per_caller():
  # Two independent "leaves" share one limiter: together they never exceed it.
  async def main():
    lim = ByteLimiter(64)
    held = []

    async def leaf(chunks):
      for n in chunks:
        g = await lim.acquire(n)
        held.append(lim.in_use)
        await asyncio.sleep(0)
        lim.release(g)

    await asyncio.gather(leaf([40] * 20), leaf([40] * 20), leaf([20] * 20))
    return held
  held = run(main())
  assert max(held) <= 64
  assert max(held) == 60  # a 40 and a 20 did run together
  assert np.mean(held) > 20
