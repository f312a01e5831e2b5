# edge_llm_ros on a Jetson Orin with JetPack 6 (L4T r36, Ubuntu 22.04) and ROS 2 Humble.
# FROM the jetson-containers ROS 2 Humble image for L4T r36 (arm64, CUDA, ROS under
# /opt/ros/humble/install). Pick the tag that matches the board's L4T release
# (cat /etc/nv_tegra_release). setup.sh finds Humble and builds against it
# (edge_llm_ros/bringup/ros_install.py).
#   docker build -f docker/jetpack6-humble.Dockerfile -t edge_llm_ros:jetpack6 .
#   docker run --rm -it --runtime nvidia edge_llm_ros:jetpack6     # the quickstart
# onnxruntime with CUDA: PyPI's aarch64 wheel is CPU only. Install NVIDIA's onnxruntime-gpu
# wheel for JetPack 6 into the base image's python first (its `onnxruntime` module is then
# kept: setup.sh skips PyPI's onnxruntime when the system python already has one), e.g.
#   docker build --build-arg ORT_WHEEL=onnxruntime_gpu-<version>-cp310-cp310-linux_aarch64.whl ...
# with the wheel in the build context.
ARG BASE_IMAGE=dustynv/ros:humble-ros-base-l4t-r36.2.0
FROM ${BASE_IMAGE}
ARG ORT_WHEEL=
ENV ROS_DISTRO=humble
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv python3-pip cmake g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/edge_llm_ros
COPY . .
RUN if [ -n "$ORT_WHEEL" ]; then python3 -m pip install --no-deps "$ORT_WHEEL"; fi
RUN bash scripts/setup.sh
CMD ["bash", "scripts/quickstart.sh"]
