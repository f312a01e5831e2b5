# edge_llm_ros on ROS 2 Jazzy, for x86_64 and arm64 (Raspberry Pi 5, RK3588 boards, PCs).
# FROM the official ROS image (multi-arch): setup.sh finds /opt/ros/jazzy and builds against
# it (edge_llm_ros/bringup/ros_install.py), so no second ROS comes from PyPI.
#   docker build -f docker/jazzy.Dockerfile -t edge_llm_ros:jazzy .
#   docker buildx build --platform linux/arm64 -f docker/jazzy.Dockerfile -t edge_llm_ros:jazzy-arm64 .
#   docker run --rm -it edge_llm_ros:jazzy                        # the quickstart
ARG BASE_IMAGE=ros:jazzy-ros-base
FROM ${BASE_IMAGE}
ENV ROS_DISTRO=jazzy
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv python3-pip cmake g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/edge_llm_ros
COPY . .
RUN bash scripts/setup.sh
CMD ["bash", "scripts/quickstart.sh"]
