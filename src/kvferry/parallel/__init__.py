"""Process groups and collectives for tensor, pipeline and expert
parallelism on one host or over nodes (DESIGN.md: with -tp/-pp/EP one core is N rank
processes). No model code lives here.

    group.py     ProcessGroup: rank, world size, all_reduce / all_gather / all_to_all / broadcast / barrier
    launch.py    launch(): start N rank processes, join them, and end the group whole if one fails
    shm_all_reduce.py  ShmAllReduce: a group's float sums through shared memory (ranks on one host)
    tcp_group.py  TcpGroup: all_reduce / all_gather through rank 0 over tcp:// (ranks on other nodes)
    rank_sockets.py  RankKeys: CURVE on the ranks' tcp:// sockets (only holders of the socket secret connect)
"""
from kvferry.parallel.group import CollectiveError, GroupAddress, ProcessGroup
from kvferry.parallel.launch import RankFailed, launch
from kvferry.parallel.shm_all_reduce import ShmAllReduce

__all__ = ["CollectiveError", "GroupAddress", "ProcessGroup", "RankFailed", "ShmAllReduce", "launch"]
