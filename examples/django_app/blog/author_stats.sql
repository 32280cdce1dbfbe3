-- Every author's figures, from scratch (the recompute).
select a.id as author_id,
       count(p.id)::integer as posts,
       coalesce(sum(p.words), 0)::integer as words,
       max(p.created_at) as last_post_at
from author a
left join post p on p.author_id = a.id
group by a.id
