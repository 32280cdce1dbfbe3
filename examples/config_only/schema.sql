-- A shop: customers, their orders, and a derived per-customer total that a
-- pgjobs recompute keeps up to date. No Python of ours is involved.

create table customer (
    id    bigint primary key,
    name  text not null
);

create table orders (
    id           bigint primary key,
    customer_id  bigint not null references customer on delete cascade,
    amount       numeric(12, 2) not null
);

-- The derived table: its primary key is the diff key, its foreign key tells
-- pgjobs which parent rows to lock (FOR KEY SHARE, in key order) before writing.
create table customer_total (
    customer_id  bigint primary key references customer on delete cascade,
    orders       integer not null,
    amount       numeric(12, 2) not null
);

insert into customer (id, name) select g, 'customer ' || g from generate_series(1, 100) g;
insert into orders (id, customer_id, amount)
select g, 1 + g % 100, (g % 17) * 3.25 from generate_series(1, 1000) g;
