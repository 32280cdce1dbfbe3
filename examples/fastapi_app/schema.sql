-- A blog: authors, their posts, and per-author figures that pgjobs keeps up
-- to date. Applied by the application's own migrations (here: by hand).

create table author (
    id    bigint primary key,
    name  text not null
);

create table post (
    id          bigserial primary key,
    author_id   bigint not null references author on delete cascade,
    title       text not null,
    created_at  timestamptz not null default now()
);

-- Derived: rewritten by the jobs in pgjobs.toml, never by request handlers.
create table author_stats (
    author_id     bigint primary key references author on delete cascade,
    posts         integer not null,
    last_post_at  timestamptz
);

insert into author (id, name) select g, 'author ' || g from generate_series(1, 50) g;
