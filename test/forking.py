"""fork() for tests that run in the pytest process after ROS tests."""
import gc
import os


def fork_clean() -> int:
    """Return os.fork()'s result; the child never garbage-collects the parent's objects.

    Earlier tests of the same pytest process leave cyclic garbage holding rclpy and DDS
    handles. Their finalizers need locks and threads that do not exist in a forked child:
    a collection there crashed children with SIGSEGV under load. So collect in the parent
    (where finalizers are safe) and freeze what is left: the child's collections then see
    only the objects it creates itself.
    """
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
    return pid
