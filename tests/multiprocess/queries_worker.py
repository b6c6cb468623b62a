"""Worker: the "log from rank 0" pattern. Two processes save steps 1-3;
process 0 alone asks every read-only query between the saves, process 1
alone asks some too; the job's later save and restore must work on both,
and no query may wait for the other process."""

import json
import sys
import time

from ckpt.multihost import local_cluster


def main():
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.grid_leaf import GridLeaf  # pylint: disable=g-import-not-at-top

  me = jax.process_index()
  leaf = GridLeaf()
  state = leaf.state

  c = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout"],
                        best_metric="loss", keep=5)
  answers, slowest = {}, 0.0
  for s in (1, 2, 3):
    c.save(s, state(s), metrics={"loss": 10.0 - s}, host_state={"p": me})
    c.wait_until_finished()
    t = time.monotonic()
    if me == 0:  # rank-0 logging: the other process does not call these
      answers[s] = {"all": c.all_steps(), "latest": c.latest_step(),
                    "best": c.best_step(), "metrics": c.metrics(s),
                    "meta": sorted(c.metadata(s).shardings),
                    "host_state": c.host_state(s),
                    "should": c.should_save(s + 1)}
    elif s == 2:
      answers[s] = {"all": c.all_steps(), "host_state": c.host_state()}
    slowest = max(slowest, time.monotonic() - t)
  got = c.restore(target=leaf.target)  # collective, on both
  exact = leaf.exact(got, 3)
  c.save(4, state(4))
  c.close()
  local_cluster.write_result({"process": me, "answers": answers,
                              "slowest_query_s": slowest, "exact": exact,
                              "restored": c.last_restore_step})


if __name__ == "__main__":
  main()
