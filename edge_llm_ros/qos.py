"""QoS profiles of llm_node's interfaces, shared by the node, its clients and tools.

One definition per meaning, so a publisher and its subscribers can never drift apart.
"""
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

# Action feedback is best kept complete: a deeper history than rclpy's default of 10.
FEEDBACK_QOS = QoSProfile(depth=100, history=HistoryPolicy.KEEP_LAST,
                          reliability=ReliabilityPolicy.RELIABLE)

# ~/transcript is latched: a recorder or dashboard that starts late still receives the last
# TRANSCRIPT_DEPTH records (transient-local durability keeps them in the publisher).
TRANSCRIPT_DEPTH = 100
TRANSCRIPT_QOS = QoSProfile(depth=TRANSCRIPT_DEPTH, history=HistoryPolicy.KEEP_LAST,
                            reliability=ReliabilityPolicy.RELIABLE,
                            durability=DurabilityPolicy.TRANSIENT_LOCAL)

# ~/detections: one message per grounded answer, each an event a consumer must not miss
# (reliable), and only for those listening when it is answered (volatile: a late subscriber
# must not act on where the cup was minutes ago).
DETECTIONS_QOS = QoSProfile(depth=10, history=HistoryPolicy.KEEP_LAST,
                            reliability=ReliabilityPolicy.RELIABLE,
                            durability=DurabilityPolicy.VOLATILE)
