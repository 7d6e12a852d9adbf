# Operator image: the kopf operator and its API/GCS clients only (no JAX).
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY contract/ /app/contract/
COPY operator/ /app/operator/
RUN pip install --no-cache-dir /app/contract /app/operator \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin tpujob

USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "tpujob_operator"]
