"""The ZeroMQ weight path: the one that always works (across hosts, for late joiners).

The learner's ``server`` serves each published snapshot chunk by chunk to its
``peers`` within ``limits``; a replica's ``client`` pulls the versions newer than
the one it holds, behind the chain's ``source`` interface."""
