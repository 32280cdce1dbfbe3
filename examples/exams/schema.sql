-- The exams scenario (the one `pgjobs demo` runs).
--
--   exam         the parents: users delete them, merge one into another, change them
--   submission   the source data the scores are computed from
--   exam_score   the derived rows pgjobs rewrites (a foreign key to exam, cascading)
--   exam_status  one row per exam, upserted after its scores are written

create table exam (
    id      bigint primary key,
    title   text not null,
    weight  integer not null
);

create table submission (
    exam_id     bigint not null references exam on delete cascade,
    student_id  integer not null,
    points      integer not null,
    primary key (exam_id, student_id)
);

create table exam_score (
    exam_id     bigint not null references exam on delete cascade,
    student_id  integer not null,
    score       integer not null,
    primary key (exam_id, student_id)
);

create table exam_status (
    exam_id    bigint primary key references exam on delete cascade,
    students   integer not null,
    scored_at  timestamptz not null
);

-- Some data to play with: 1,000 exams of 5 students.
insert into exam (id, title, weight)
select g, 'exam ' || g, 1 + g % 3 from generate_series(1, 1000) g;

insert into submission (exam_id, student_id, points)
select e, s, (e * 37 + s * 11) % 101 from generate_series(1, 1000) e, generate_series(1, 5) s;
