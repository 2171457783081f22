# The image a fleet can run (fleet.yaml `image:`): harvest in a venv, entry point `harvest`.
#   make image                        # CPU variant, from a local wheelhouse (offline build)
#   make image VARIANT=tpu BASE_IMAGE=python:3.11-slim
# Build args: BASE_IMAGE (any Debian-like image with python3 >= 3.10 and venv), VARIANT cpu | tpu | cuda.
# The context's wheelhouse/ holds harvest's wheel (harvest_activations-*.whl: the distribution is
# harvest-activations, which no package index serves; the index's `harvest` is another project). With the
# dependencies' wheels there too (as `make image` builds it), it installs from them only (--no-index); with
# harvest's wheel alone, the dependencies come from PyPI.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG VARIANT=cpu
COPY wheelhouse/ /tmp/wheelhouse/
RUN set -eu; \
    case "$VARIANT" in \
      cpu) extras=gcs,s3 ;; tpu) extras=tpu,gcs,s3 ;; cuda) extras=cuda,gcs,s3 ;; \
      *) echo "VARIANT must be cpu, tpu or cuda, got $VARIANT" >&2; exit 2 ;; \
    esac; \
    if ! ls /tmp/wheelhouse/harvest_activations-*.whl >/dev/null 2>&1; then \
      echo "wheelhouse/ holds no harvest_activations wheel: build the image with make image" >&2; exit 2; \
    fi; \
    python3 -m venv /opt/harvest; \
    if [ "$(ls /tmp/wheelhouse/*.whl | wc -l)" -gt 1 ]; then index=--no-index; else index=; fi; \
    /opt/harvest/bin/pip install --no-cache-dir $index --find-links /tmp/wheelhouse "harvest-activations[$extras]"; \
    rm -rf /tmp/wheelhouse
ENV PATH=/opt/harvest/bin:$PATH HARVEST_CACHE=/var/cache/harvest
ENTRYPOINT ["harvest"]
CMD ["--help"]
