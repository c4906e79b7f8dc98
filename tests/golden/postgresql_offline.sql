BEGIN;

CREATE TABLE quota_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT quota_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> 0001_counters

CREATE UNLOGGED TABLE quota_counters (
    bucket_key TEXT COLLATE "C" NOT NULL, 
    client_key TEXT COLLATE "C" NOT NULL, 
    window_start BIGINT NOT NULL, 
    window_seconds INTEGER NOT NULL, 
    count BIGINT NOT NULL, 
    updated_at FLOAT NOT NULL, 
    PRIMARY KEY (bucket_key)
);

CREATE INDEX ix_quota_counters_window_end ON quota_counters ((window_start + window_seconds));

ALTER TABLE quota_counters SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);

INSERT INTO quota_alembic_version (version_num) VALUES ('0001_counters') RETURNING quota_alembic_version.version_num;

-- Running upgrade 0001_counters -> 0002_quotas

CREATE TABLE quota_usage (
    subject TEXT COLLATE "C" NOT NULL, 
    name TEXT COLLATE "C" NOT NULL, 
    period_start BIGINT NOT NULL, 
    period_end BIGINT NOT NULL, 
    period TEXT NOT NULL, 
    tz TEXT, 
    quota_limit BIGINT, 
    used BIGINT NOT NULL, 
    granted BIGINT NOT NULL, 
    updated_at FLOAT NOT NULL, 
    CONSTRAINT pk_quota_usage PRIMARY KEY (subject, name, period_start), 
    CONSTRAINT ck_quota_usage_used CHECK (used >= 0), 
    CONSTRAINT ck_quota_usage_granted CHECK (granted >= 0)
);

CREATE TABLE quota_ledger (
    id BIGSERIAL NOT NULL, 
    at FLOAT NOT NULL, 
    subject TEXT COLLATE "C" NOT NULL, 
    name TEXT COLLATE "C" NOT NULL, 
    kind TEXT NOT NULL, 
    cost BIGINT NOT NULL, 
    idempotency_key TEXT COLLATE "C", 
    period_start BIGINT, 
    period_end BIGINT, 
    quota_limit BIGINT, 
    used BIGINT, 
    remaining BIGINT, 
    refunded_at FLOAT, 
    PRIMARY KEY (id), 
    CONSTRAINT ck_quota_ledger_kind CHECK (kind IN ('consume', 'deny', 'refund', 'grant', 'rate_denied'))
);

CREATE UNIQUE INDEX uq_quota_ledger_idempotency ON quota_ledger (subject, name, idempotency_key) WHERE kind = 'consume' AND refunded_at IS NULL;

CREATE INDEX ix_quota_ledger_subject_at ON quota_ledger (subject, at);

CREATE INDEX ix_quota_ledger_at ON quota_ledger (at);

ALTER TABLE quota_usage SET (fillfactor = 80);

UPDATE quota_alembic_version SET version_num='0002_quotas' WHERE quota_alembic_version.version_num = '0001_counters';

-- Running upgrade 0002_quotas -> 0003_algorithms

CREATE UNLOGGED TABLE quota_state (
    bucket_key TEXT COLLATE "C" NOT NULL, 
    client_key TEXT COLLATE "C" NOT NULL, 
    window_seconds INTEGER NOT NULL, 
    value FLOAT NOT NULL, 
    prev_value FLOAT NOT NULL, 
    stamp FLOAT NOT NULL, 
    allowed SMALLINT NOT NULL, 
    expires_at FLOAT NOT NULL, 
    PRIMARY KEY (bucket_key)
);

CREATE INDEX ix_quota_state_expires_at ON quota_state (expires_at);

ALTER TABLE quota_state SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);

UPDATE quota_alembic_version SET version_num='0003_algorithms' WHERE quota_alembic_version.version_num = '0002_quotas';

-- Running upgrade 0003_algorithms -> 0004_policies

CREATE TABLE quota_policies (
    route TEXT NOT NULL, 
    subject TEXT DEFAULT '*' NOT NULL, 
    rates TEXT, 
    algorithm TEXT, 
    cost INTEGER, 
    fail_open BOOLEAN, 
    exempt BOOLEAN DEFAULT false NOT NULL, 
    note TEXT, 
    updated_at FLOAT NOT NULL, 
    CONSTRAINT pk_quota_policies PRIMARY KEY (route, subject), 
    CONSTRAINT ck_quota_policies_cost CHECK (cost IS NULL OR cost >= 1)
);

UPDATE quota_alembic_version SET version_num='0004_policies' WHERE quota_alembic_version.version_num = '0003_algorithms';

-- Running upgrade 0004_policies -> 0005_settings

CREATE TABLE quota_settings (
    name TEXT NOT NULL, 
    value TEXT, 
    note TEXT, 
    updated_at FLOAT NOT NULL, 
    CONSTRAINT pk_quota_settings PRIMARY KEY (name)
);

UPDATE quota_alembic_version SET version_num='0005_settings' WHERE quota_alembic_version.version_num = '0004_policies';

-- Running upgrade 0005_settings -> 0006_leases

CREATE TABLE quota_leases (
    lease_key TEXT COLLATE "C" NOT NULL, 
    slot INTEGER NOT NULL, 
    holder TEXT NOT NULL, 
    slots INTEGER NOT NULL, 
    acquired_at FLOAT NOT NULL, 
    expires_at FLOAT NOT NULL, 
    CONSTRAINT pk_quota_leases PRIMARY KEY (lease_key, slot)
);

CREATE INDEX ix_quota_leases_expires_at ON quota_leases (expires_at);

UPDATE quota_alembic_version SET version_num='0006_leases' WHERE quota_alembic_version.version_num = '0005_settings';

-- Running upgrade 0006_leases -> 0007_reservations

ALTER TABLE quota_usage ADD COLUMN reserved BIGINT DEFAULT '0' NOT NULL;

ALTER TABLE quota_usage ADD COLUMN next_expiry FLOAT;

ALTER TABLE quota_ledger ADD COLUMN reservation_id TEXT COLLATE "C";

ALTER TABLE quota_ledger ADD COLUMN reserved BIGINT;

ALTER TABLE quota_ledger DROP CONSTRAINT ck_quota_ledger_kind;

ALTER TABLE quota_ledger ADD CONSTRAINT ck_quota_ledger_kind CHECK (kind IN ('consume', 'deny', 'refund', 'grant', 'rate_denied', 'reserve', 'settle', 'release'));

CREATE TABLE quota_reservations (
    id TEXT COLLATE "C" NOT NULL, 
    subject TEXT COLLATE "C" NOT NULL, 
    name TEXT COLLATE "C" NOT NULL, 
    period_start BIGINT NOT NULL, 
    period_end BIGINT NOT NULL, 
    period TEXT NOT NULL, 
    tz TEXT, 
    quota_limit BIGINT NOT NULL, 
    amount BIGINT NOT NULL, 
    idempotency_key TEXT COLLATE "C", 
    created_at FLOAT NOT NULL, 
    expires_at FLOAT NOT NULL, 
    state TEXT NOT NULL, 
    ended_at FLOAT, 
    outcome TEXT, 
    thresholds TEXT, 
    CONSTRAINT pk_quota_reservations PRIMARY KEY (id), 
    CONSTRAINT ck_quota_reservations_state CHECK (state IN ('held', 'settled', 'released'))
);

CREATE INDEX ix_quota_reservations_live ON quota_reservations (subject, name, period_start, expires_at) WHERE state = 'held';

CREATE INDEX ix_quota_reservations_expires_at ON quota_reservations (expires_at);

CREATE UNIQUE INDEX uq_quota_reservations_idempotency ON quota_reservations (subject, name, idempotency_key) WHERE idempotency_key IS NOT NULL;

UPDATE quota_alembic_version SET version_num='0007_reservations' WHERE quota_alembic_version.version_num = '0006_leases';

-- Running upgrade 0007_reservations -> 0008_thresholds

CREATE TABLE quota_events (
    id BIGSERIAL NOT NULL, 
    subject TEXT COLLATE "C" NOT NULL, 
    quota TEXT COLLATE "C" NOT NULL, 
    period_start BIGINT NOT NULL, 
    threshold TEXT NOT NULL, 
    used BIGINT NOT NULL, 
    quota_limit BIGINT NOT NULL, 
    at FLOAT NOT NULL, 
    rearmed_at FLOAT, 
    delivered_at FLOAT, 
    attempts INTEGER NOT NULL, 
    claimed_until FLOAT, 
    claimed_by TEXT, 
    last_error TEXT, 
    PRIMARY KEY (id)
);

CREATE UNIQUE INDEX uq_quota_events_armed ON quota_events (subject, quota, period_start, threshold) WHERE rearmed_at IS NULL;

CREATE INDEX ix_quota_events_undelivered ON quota_events (id) WHERE delivered_at IS NULL;

CREATE INDEX ix_quota_events_delivered_at ON quota_events (delivered_at);

UPDATE quota_alembic_version SET version_num='0008_thresholds' WHERE quota_alembic_version.version_num = '0007_reservations';

COMMIT;

