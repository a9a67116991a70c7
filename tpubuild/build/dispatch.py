"""How `doit -n N` hands ready tasks to its processes: doit 0.37's dispatcher and multiprocess runner, with a
priority among ready tasks and each process's own job queue.

doit hands ready tasks to free processes in the order they became ready, through one queue that any free
process reads. Two things that cost a build:

- PP-OCRv4 rec's search, the longest stage of its matrix, became ready while four short F32/BF16 stages
  queued, and waited a second for them with both processes busy; PP-OCR cls's INT8 codegen waited behind two
  report pages. doit has no priorities to set: ``_next_by_priority`` is its method with one (tasks.DISPATCH).
- A stage reads the module the stage before it saved, and a process that saved it hands it over without
  parsing (tpubuild.ir.mlir), with the compiler's modules imported. Through one shared queue a chain of stages
  (lower -> layer group -> assign -> codegen -> chip run) went from process to process, each then importing
  and parsing: rec's INT8 chain after the search took 5.4 s with two processes, 3.0 s in one. Here each
  process has its own queue, and a task goes to a free process that made any of its inputs (``assign``,
  ``History.rank``). The order in which tasks run is doit's (with the priority).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from doit.control import TaskDispatcher
from doit.runner import JobHold, MRunner, Process


def _next_by_priority(self, ready, tasks_to_run):
    """TaskDispatcher._get_next_node taking the ready task of the highest ``meta["priority"]``, the first of them
    in doit's order.

    Only this method reads doit's ``ready`` queue, so it moves what doit appended there into a queue per priority
    (``self.by_priority``), each node's priority read once: a scan of ``ready`` at every pick made the first no-op
    over a 200-model zoo, 4,400 tasks mostly ready at once, quadratic (3 of its 3.8 s)."""
    queues = self.__dict__.setdefault("by_priority", {})
    while ready:
        node = ready.popleft()
        queues.setdefault((node.task.meta or {}).get("priority", 0), deque()).append(node)
    for priority in sorted(queues, reverse=True):  # a few priorities (tasks.DISPATCH)
        if queues[priority]:
            return queues[priority].popleft()
    return _doit_next_node(self, ready, tasks_to_run)


_doit_next_node = TaskDispatcher._get_next_node


class History:
    """What each process has run: the files it made and the stages it ran."""

    def __init__(self, processes: int):
        self.made: list[set[str]] = [set() for _ in range(processes)]
        self.stages: list[set[str]] = [set() for _ in range(processes)]

    def ran(self, process: int, task) -> None:
        self.made[process].update(task.targets)
        self.stages[process].add(task.name.split(":")[0])

    def rank(self, task, process: int) -> tuple[bool, bool]:
        """How well ``process`` suits ``task`` (lower is better): one that made any of its inputs, one that ran
        its stage."""
        stage = task.name.split(":")[0]
        return (not (self.made[process] & task.file_dep), stage not in self.stages[process])


def assign(jobs: Sequence, free: Sequence[int], rank) -> dict[int, object]:
    """Process -> job, for ``jobs`` (doit's, in its order; None: no task left, JobHold: none ready) and the
    ``free`` processes: each task in turn to the free process of the lowest ``rank(job, process)``, the first
    of them on ties (the one that just finished is first). A process given JobHold waits; None stops it."""
    left, given = list(free), {}
    for job in jobs:
        if job is not None and not isinstance(job, JobHold):
            best = min(left, key=lambda process: rank(job, process))
            given[best] = job
            left.remove(best)
    return {**given, **dict(zip(left, [job for job in jobs if job is None or isinstance(job, JobHold)], strict=False))}


class _Tagged:
    """A process's result queue: each result says which process sent it."""

    def __init__(self, queue, index: int):
        self.queue, self.index = queue, index

    def put(self, item: dict) -> None:
        item["worker"] = self.index
        self.queue.put(item)


def _serve(runner: MRunner, jobs, results, index: int, reporter_class, idle: bool) -> None:
    # no task for it yet: it imports what the stages will (stages.STAGE_MODULES); not a cluster build's client thread
    if idle and getattr(runner, "warms_up", True):
        from tpubuild.build.stages import import_stage_modules

        import_stage_modules()
    runner.execute_task_subprocess(jobs, _Tagged(results, index), reporter_class)


def _start_processes(self, job_q, result_q):
    """MRunner._run_start_processes with a job queue per process (``job_q`` unused)."""
    self.job_queues, self.held, self.history = [], [], History(self.num_process)
    procs = []
    for index in range(self.num_process):
        job = self.get_next_job(None)
        if job is None:
            break  # no more processes than tasks
        queue = self.Queue()
        if isinstance(job, JobHold):
            self.held.append(index)
        else:
            queue.put(job)
        process = self.Child(
            target=_serve, args=(self, queue, result_q, index, self.reporter.__class__, isinstance(job, JobHold))
        )
        process.start()
        self.job_queues.append(queue)
        procs.append(process)
    self.free_proc = 0  # counted in ``held``
    return procs


def _run_tasks(self, task_dispatcher):
    """MRunner.run_tasks with the jobs sent to each process's queue (``assign``)."""
    result_q = self.Queue()
    self._run_tasks_init(task_dispatcher)
    proc_list = self._run_start_processes(None, result_q)
    running = len(proc_list)
    try:
        while running:
            result = result_q.get()
            if "exit" in result:
                raise result["exit"](result["exception"])
            node = task_dispatcher.nodes[result["name"]]
            task = node.task
            if "reporter" in result:
                getattr(self.reporter, result["reporter"])(task)
                continue
            self._process_result(node, task, result)
            self.history.ran(result["worker"], task)
            running -= _hand_out(self, node, result["worker"])
    except (SystemExit, KeyboardInterrupt, Exception):
        if self.Child == Process:  # (doit's thread runner, -P thread, shares this method: threads cannot be)
            for proc in proc_list:
                proc.terminate()
        raise
    for proc in proc_list:
        proc.join()
    while not result_q.empty():  # teardown reports (the processes have ended)
        result = result_q.get()
        getattr(self.reporter, result["reporter"])(task_dispatcher.tasks[result["name"]])


def _hand_out(self, node, worker: int) -> int:
    """After ``worker`` finished ``node``: the next jobs to it and the held processes (``assign``); returns how
    many processes were told to stop."""
    free, self.held = [worker, *self.held], []
    jobs, completed = [], node
    for _ in free:
        jobs.append(self.get_next_job(completed))
        completed = None
    self.free_proc = 0
    stopped = 0
    for index, job in assign(jobs, free, lambda job, process: self.history.rank(self.tasks[job.name], process)).items():
        if isinstance(job, JobHold):
            self.held.append(index)
            continue
        if job is None:
            stopped += 1
        self.job_queues[index].put(job)
    return stopped


def install() -> None:
    """doit's dispatcher with priorities, its multiprocess runner with a queue per process."""
    TaskDispatcher._get_next_node = _next_by_priority
    MRunner._run_start_processes = _start_processes
    MRunner.run_tasks = _run_tasks
